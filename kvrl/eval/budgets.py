"""Accuracy under KV budgets: the default job (``python -m kvrl.run``).

Evaluates a model on its environment with the full cache and with a sink+recent window at
budgets given as fractions of the average full-cache sequence length, and prints a table.
With ``rlkv.gates`` (an RLKV run's exported gates) it adds RLKV's head reallocation at
``rlkv.sparsity``: the lowest-gated heads keep ``rlkv.eval_sink`` + ``rlkv.eval_recent``.
Budgets are fractions of the sequence rather than token counts so that the same recipe is
meaningful for any task family.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from kvrl.engines.hf import HFEngine, Sampling
from kvrl.envs import make
from kvrl.envs.base import Task
from kvrl.kernels.replay import NEVER

DeathFn = Callable[[list[Task], int], torch.Tensor]


def window_death(config, batch: int, T: int, sink: int, recent: int, device="cpu") -> torch.Tensor:
    """Sink+recent for every head of a model ``config``: key k >= sink dies at query
    k + recent. [L, B, H, T]."""
    k = torch.arange(T, dtype=torch.int64)
    death = torch.where(k < sink, torch.full_like(k, NEVER), k + recent).to(torch.int32)
    return death.expand(config.num_hidden_layers, batch, config.num_key_value_heads, T).to(device)


def evaluate(engine: HFEngine, env, tasks: list[Task], max_new_tokens: int, death_fn: DeathFn | None = None,
             batch_size: int = 64, desc: str = "eval", policy=None) -> dict:
    """Greedy accuracy and metrics of ``tasks`` in ``engine`` (HF or vLLM) under ``policy``
    (as ``engine.generate`` takes it), or the static pattern ``death_fn(batch, T)``."""
    texts, tokens, rewards, infos = [], [], [], []
    for i in tqdm(range(0, len(tasks), batch_size), desc=desc, leave=False):
        batch = tasks[i:i + batch_size]
        T = max(len(engine.tokenizer(t.prompt)["input_ids"]) for t in batch) + max_new_tokens + 1
        out = engine.generate([t.prompt for t in batch], Sampling(max_new_tokens), policy=policy,
                              death=None if death_fn is None else death_fn(batch, T))
        texts += out.texts
        tokens += out.tokens
        for t, text in zip(batch, out.texts):
            r, info = env.score(t, text)
            rewards.append(r)
            infos.append(info)
    prompt_len = [len(engine.tokenizer(t.prompt)["input_ids"]) for t in tasks]
    seq_len = [p + len(g) + 1 for p, g in zip(prompt_len, tokens)]  # + EOS
    return {"acc": float(np.mean(rewards)), "texts": texts, "tokens": tokens,
            "mean_seq_len": float(np.mean(seq_len)),
            "cot_fraction": float(np.mean([(s - p) / s for s, p in zip(seq_len, prompt_len)])),
            "metrics": {k: float(np.mean([i[k] for i in infos])) for k in infos[0]}}


def main(cfg) -> dict:
    """The budget table on ``workers.engine`` (hf, or vllm: the head-reallocated row is
    then vLLM's own head reallocation)."""
    from transformers import AutoConfig

    from kvrl.engines import make_engine
    from kvrl.models.tiny import resolve_path

    torch.manual_seed(cfg.seed)
    engine = make_engine(cfg)
    config = AutoConfig.from_pretrained(resolve_path(cfg.model.path))
    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=cfg.seed)
    tasks = env.tasks(cfg.env.num_eval_tasks)
    n_new = cfg.sampling.max_new_tokens
    full = evaluate(engine, env, tasks, n_new, batch_size=cfg.sampling.batch_size, desc="full cache")
    rows = [{"policy": "full", "budget": None, "acc": full["acc"]}]
    for frac in cfg.eval.budgets:
        budget = round(frac * full["mean_seq_len"])
        if budget <= cfg.kv.sink:
            raise ValueError(f"eval.budgets entry {frac} gives {budget} tokens, not more than kv.sink={cfg.kv.sink}; "
                             "raise the fraction or lower kv.sink")
        res = evaluate(engine, env, tasks, n_new, batch_size=cfg.sampling.batch_size, desc=f"window {frac:g}",
                       death_fn=lambda b, T: window_death(config, len(b), T, cfg.kv.sink, budget - cfg.kv.sink,
                                                          cfg.device))
        rows.append({"policy": f"sink{cfg.kv.sink}+recent", "budget": budget, "budget_frac": frac, "acc": res["acc"]})
    if cfg.rlkv.gates:  # RLKV's head reallocation: the lowest-gated heads keep eval_sink + eval_recent only
        from kvrl.algos.rlkv import head_allocation

        r = cfg.rlkv
        heads = head_allocation(r.gates, r.sparsity, config, sink=r.eval_sink, recent=r.eval_recent)
        res = evaluate(engine, env, tasks, n_new, batch_size=cfg.sampling.batch_size, desc="rlkv heads",
                       policy=heads)
        rows.append({"policy": f"rlkv s={r.sparsity:g}", "budget": None, "acc": res["acc"],
                     "compressed_heads": int(heads.compressed_mask().sum())})
    print(f"\n{len(tasks)} tasks of {cfg.env.id}; mean sequence {full['mean_seq_len']:.1f} tokens, "
          f"chain of thought {100 * full['cot_fraction']:.0f} %")
    print(f"{'policy':<16}{'budget':>10}{'accuracy':>10}")
    for r in rows:
        b = "-" if r["budget"] is None else f"{r['budget']} ({r['budget_frac']:.0%})"
        print(f"{r['policy']:<16}{b:>10}{r['acc']:>10.3f}")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"rows": rows, "mean_seq_len": full["mean_seq_len"], "cot_fraction": full["cot_fraction"]}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    return result
