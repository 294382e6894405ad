"""job=eval_budgets: accuracy with the full cache and sink+recent windows, as a table.

    python -m kvrl.run recipe=tiny_eval

The budgets are fractions of the mean full-cache sequence length (``eval.budgets``), so one
recipe means the same for any task family. With ``rlkv.gates`` (an RLKV run's exported
gates) a row for RLKV's head reallocation at ``rlkv.sparsity`` is added: the lowest-gated
heads keep ``rlkv.eval_sink`` + ``rlkv.eval_recent`` tokens. Runs on ``workers.engine``
(with vllm the head-reallocated row is vLLM's own head reallocation). Writes
``output_dir/results.json``.
"""

from __future__ import annotations

from transformers import AutoConfig

from kvrl.engines import make_engine
from kvrl.envs import make
from kvrl.eval.budgets import evaluate
from kvrl.models.tiny import resolve_path
from kvrl.policies import Static, Window
from kvrl.policies.heads import head_allocation
from kvrl.runlog import setup_process, write_json


def main(cfg) -> dict:
    # ---- the model, its environment and the evaluation tasks
    setup_process(cfg.seed, threads=None)
    engine = make_engine(cfg)
    config = AutoConfig.from_pretrained(resolve_path(cfg.model.path))
    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=cfg.seed)
    tasks = env.tasks(cfg.env.num_eval_tasks)
    n_new, batch = cfg.sampling.max_new_tokens, cfg.sampling.batch_size

    # ---- the full cache: the reference row, and the sequence length budgets are fractions of
    full = evaluate(engine, env, tasks, n_new, batch_size=batch, desc="full cache")
    rows = [{"policy": "full", "budget": None, "acc": full["acc"]}]

    # ---- sink + recent at each budget
    for frac in cfg.eval.budgets:
        budget = round(frac * full["mean_seq_len"])
        if budget <= cfg.kv.sink:
            raise ValueError(f"eval.budgets entry {frac} gives {budget} tokens, not more than kv.sink={cfg.kv.sink}; "
                             "raise the fraction or lower kv.sink")
        window = Static(Window.of(config, cfg.kv.sink, budget - cfg.kv.sink))
        res = evaluate(engine, env, tasks, n_new, batch_size=batch, desc=f"window {frac:g}", policy=window)
        rows.append({"policy": f"sink{cfg.kv.sink}+recent", "budget": budget, "budget_frac": frac, "acc": res["acc"]})

    # ---- RLKV's head reallocation: the lowest-gated heads keep eval_sink + eval_recent only
    if cfg.rlkv.gates:
        r = cfg.rlkv
        heads = head_allocation(r.gates, r.sparsity, config, sink=r.eval_sink, recent=r.eval_recent)
        res = evaluate(engine, env, tasks, n_new, batch_size=batch, desc="rlkv heads", policy=heads)
        rows.append({"policy": f"rlkv s={r.sparsity:g}", "budget": None, "acc": res["acc"],
                     "compressed_heads": int(heads.compressed_mask().sum())})

    # ---- the table and results.json
    print(f"\n{len(tasks)} tasks of {cfg.env.id}; mean sequence {full['mean_seq_len']:.1f} tokens, "
          f"chain of thought {100 * full['cot_fraction']:.0f} %")
    print(f"{'policy':<16}{'budget':>10}{'accuracy':>10}")
    for r in rows:
        b = "-" if r["budget"] is None else f"{r['budget']} ({r['budget_frac']:.0%})"
        print(f"{r['policy']:<16}{b:>10}{r['acc']:>10.3f}")
    result = {"rows": rows, "mean_seq_len": full["mean_seq_len"], "cot_fraction": full["cot_fraction"]}
    write_json(f"{cfg.output_dir}/results.json", result)
    return result
