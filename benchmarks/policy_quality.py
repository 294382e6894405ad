"""Accuracy vs KV budget for every policy on the tiny reasoner.

Budgets are fractions (0.25 / 0.5 / 0.75) of the mean full-cache sequence length; every
policy runs with interval 16, window 8, sink 4 (the tiny reasoner's sequences are ~180
tokens). Greedy decoding, same held-out tasks for every row. Prints one JSON line and
writes ``outputs/policy_quality.png``.

    python benchmarks/policy_quality.py [--tasks 128] [--model tiny]
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvrl.engines.hf import HFEngine
from kvrl.engines.base import Sampling
from kvrl.envs import make
from kvrl.models.tiny import load_model
from kvrl.policies import POLICIES, make_policy

FRACTIONS = (0.25, 0.5, 0.75)
INTERVAL, WINDOW, SINK = 16, 8, 4


def policy(name, model, budget):
    return make_policy(name, model.config, budget=budget, interval=INTERVAL, window=WINDOW, sink=SINK)


def run(engine, env, tasks, kv_policy, batch_size, max_new_tokens):
    """(accuracy, mean sequence length incl. EOS) of greedy decoding under kv_policy."""
    rewards, lengths = [], []
    for i in range(0, len(tasks), batch_size):
        chunk = tasks[i:i + batch_size]
        out = engine.generate([t.prompt for t in chunk], Sampling(max_new_tokens), policy=kv_policy)
        rewards += [env.score(t, text)[0] for t, text in zip(chunk, out.texts)]
        lengths += [len(p) + len(g) + 1 for p, g in zip(out.prompt_ids, out.tokens)]
    return float(np.mean(rewards)), float(np.mean(lengths))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=128)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plot", default="outputs/policy_quality.png")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    engine = HFEngine(model, tok)
    env = make("kvrl/counts-v0")
    env.reset(seed=args.seed)
    tasks = env.tasks(args.tasks)
    full_acc, mean_len = run(engine, env, tasks, None, args.batch_size, args.max_new_tokens)
    budgets = {f: round(f * mean_len) for f in FRACTIONS}
    acc = {}
    for name in tqdm(POLICIES, desc="policies"):
        acc[name] = {f: run(engine, env, tasks, policy(name, model, b), args.batch_size, args.max_new_tokens)[0]
                     for f, b in budgets.items()}

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in acc.items():
        ax.plot(list(row), list(row.values()), marker="o", label=name)
    ax.axhline(full_acc, color="k", linestyle="--", label="full cache")
    ax.set_xlabel("KV budget (fraction of the mean sequence)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{args.model}: {len(tasks)} counts tasks, "
                 f"mean sequence {mean_len:.0f} tokens", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(json.dumps({"model": args.model, "tasks": len(tasks), "mean_seq_len": mean_len,
                      "interval": INTERVAL, "window": WINDOW, "sink": SINK,
                      "budgets": {str(f): b for f, b in budgets.items()}, "full_acc": full_acc,
                      "acc": {n: {str(f): a for f, a in row.items()} for n, row in acc.items()},
                      "plot": args.plot}))


if __name__ == "__main__":
    main()
