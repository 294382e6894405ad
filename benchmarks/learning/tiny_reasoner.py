"""Is the tiny reasoner a genuine testbed for decode-time KV compression?

Prints one JSON line, all measured in this run on the same held-out tasks (greedy):
  full_acc        full-cache accuracy                                  (want >= 0.95)
  window25_acc    sink+recent at 25 % of the mean sequence             (want <= 0.5 x full)
  window50_acc    sink+recent at 50 %
  oracle25_acc    BOS + the prompt's "d ;" pairs not yet copied + recent, 25 %
  oracle50_acc    same oracle at 50 %                                  (want >= 0.9)
  oracleNN_peak_keys  the most keys the oracle ever keeps (<= budgetNN means it fits;
                  at 25 % it cannot: the unread digits alone are half the sequence)
  cot_fraction    generated tokens / sequence, averaged                (want >= 1/3)
  window_full_equal  sink+recent with a budget larger than any sequence gives exactly the
                  tokens of transformers' own generate() with sdpa attention
Eviction is replayed as attention masks (masking a key == evicting it).

    python benchmarks/learning/tiny_reasoner.py [--tasks 256] [--model tiny]
"""

import argparse

import torch

from kvrl.bench import draw_tasks, emit, reasoner
from kvrl.eval.budgets import evaluate
from kvrl.kernels.reference.replay import NEVER
from kvrl.models.tiny import load_model
from kvrl.policies import Static, Window

SINK = 4


def oracle_death(model, tasks, T: int, budget: int) -> tuple[torch.Tensor, int]:
    """Keep BOS and every ``d ;`` pair of the prompt until the query that copies the digit
    (digit j, at position 2j-1, is copied by the query at 2N+2j-1), and a recent window
    filling the rest of the budget (at least 2 tokens). Returns the pattern and its peak
    number of visible keys (at the first copy: BOS + 2N + recent)."""
    cfg = model.config
    k = torch.arange(T)
    rows, peak = [], 0
    for t in tasks:
        n = len(t.meta["digits"])
        recent = max(2, budget - 1 - 2 * n)
        d = k + recent
        d[0] = NEVER
        j = torch.arange(1, n + 1)
        for pos in (2 * j - 1, 2 * j):
            d[pos] = torch.maximum(d[pos], 2 * n + 2 * j)
        rows.append(d)
        peak = max(peak, 1 + 2 * n + recent)
    death = torch.stack(rows).to(torch.int32)[None, :, None, :]
    return death.expand(cfg.num_hidden_layers, -1, cfg.num_key_value_heads, -1).contiguous(), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok, engine = reasoner(args.model)
    env, tasks = draw_tasks("kvrl/counts-v0", args.tasks, args.seed)
    max_new = 160
    full = evaluate(engine, env, tasks, max_new, desc="full")
    res = {
        "n_tasks": len(tasks),
        "mean_seq_len": full["mean_seq_len"],
        "full_acc": full["acc"],
        "full_exact_cot": full["metrics"]["exact_cot"],
        "cot_fraction": full["cot_fraction"],
    }
    for frac in (0.25, 0.5):
        budget = round(frac * full["mean_seq_len"])
        win = evaluate(
            engine,
            env,
            tasks,
            max_new,
            desc=f"window{frac}",
            policy=Static(Window.of(model.config, SINK, budget - SINK)),
        )
        orc = evaluate(
            engine,
            env,
            tasks,
            max_new,
            desc=f"oracle{frac}",
            policy_fn=lambda b, T: Static(oracle_death(model, b, T, budget)[0]),
        )
        pct = round(100 * frac)
        res.update(
            {
                f"budget{pct}": budget,
                f"window{pct}_acc": win["acc"],
                f"oracle{pct}_acc": orc["acc"],
                f"oracle{pct}_peak_keys": oracle_death(model, tasks, max_new + 128, budget)[1],
            }
        )
    # Sanity: an unlimited window is the full cache, token for token, vs stock generate().
    sub = tasks[:64]
    unl = evaluate(engine, env, sub, max_new, policy=Static(Window.of(model.config, SINK, 10**6)))
    ref_model, _ = load_model(args.model, attn_implementation="sdpa")
    enc = tok([t.prompt for t in sub], return_tensors="pt", padding=True)
    gen = ref_model.generate(
        **enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )[:, enc["input_ids"].shape[1] :].tolist()
    # the engines' outputs end with the stop token they stopped at, as vLLM's do
    ref = [g[: g.index(tok.eos_token_id) + 1] if tok.eos_token_id in g else g for g in gen]
    res["window_full_equal"] = ref == unl["tokens"]
    res["window25_over_full"] = res["window25_acc"] / max(res["full_acc"], 1e-9)
    emit(res)


if __name__ == "__main__":
    main()
