"""G-KV post-training on the tiny reasoner: accuracy under the G-KV cache before and after
RL-Full, RL-Sparse and Distill (G-KV, arXiv 2512.00504, §5 Table 1, in miniature).

The three models are trained in this run from the same initial weights with the same
number of steps, samples per step (16 tasks x 8) and seed, each with its recipe's learning
rate (each recipe's header says why it is that one), by the RL loop (``recipes/tiny_rl_full.yaml``,
``tiny_gkv_sparse.yaml``, ``tiny_gkv_distill.yaml``);
then all four are evaluated greedily on the same held-out tasks under the same G-KV cache
(the sparse recipe's budget, interval, window, sink, α and λ), and with the full cache.
RL-Full keeps its recipe's sampling temperature (2.5, HF engine: at 2.0 its full-cache
groups are almost all right, so it would have nothing to learn; vLLM samples at <= 2).
Prints one JSON line (``train_s``: each training's wall seconds; its CPU is mostly Ray's
workers', which :func:`kvrl.bench.timed` does not see, so none is reported).

    python benchmarks/learning/gkv_train.py [--steps 40] [--tasks 128]
"""

import argparse
import json
from pathlib import Path

import numpy as np

from kvrl.bench import draw_tasks, emit, reasoner, recipe_policy, timed
from kvrl.config import load_config
from kvrl.eval.budgets import evaluate
from kvrl.jobs.rl import main as train
from kvrl.runlog import setup_process

RECIPES = {"rl_full": "tiny_rl_full", "rl_sparse": "tiny_gkv_sparse", "distill": "tiny_gkv_distill"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tasks", type=int, default=128)
    ap.add_argument("--eval-seed", type=int, default=4321)  # the training runs draw from seed 0's stream
    ap.add_argument("--out", default="outputs/gkv_train")
    args = ap.parse_args()
    setup_process()

    # ---- train the three models from the same weights, same steps / samples / seed
    models, train_stats = {"untrained": "tiny"}, {}
    for algo, recipe in RECIPES.items():
        out = Path(args.out) / algo
        cfg = load_config(
            [
                f"recipe={recipe}",
                f"trainer.steps={args.steps}",
                f"output_dir={out}",
                "resume=never",
                "rl.checkpoint_every=0",
            ]
        )
        _, wall, _ = timed(lambda: train(cfg))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        train_stats[algo] = {
            "train_s": round(wall, 1),
            "mismatch_max": max(r["mismatch_max"] for r in records),
            "reward_first5": float(np.mean([r["reward_mean"] for r in records[:5]])),
            "reward_last5": float(np.mean([r["reward_mean"] for r in records[-5:]])),
            "temperature": cfg.sampling.temperature,
            "engine": cfg.workers.engine,
            "lr": cfg.trainer.lr,
            "samples": records[-1]["samples_total"],
            "seed": cfg.seed,
        }
        models[algo] = str(out / "model")

    # ---- evaluate all four greedily under the same G-KV cache, on the same held-out tasks
    sparse = load_config([f"recipe={RECIPES['rl_sparse']}"])
    kv = sparse.kv
    env, tasks = draw_tasks(sparse.env.id, args.tasks, args.eval_seed, **sparse.env.kwargs)
    acc_gkv, acc_full = {}, {}
    for name, path in models.items():
        model, _, engine = reasoner(path)
        policy = recipe_policy("gkv", model.config, kv)
        acc_gkv[name] = evaluate(engine, env, tasks, sparse.sampling.max_new_tokens, policy=policy)["acc"]
        acc_full[name] = evaluate(engine, env, tasks, sparse.sampling.max_new_tokens)["acc"]
    emit(
        {
            "benchmark": "gkv_train",
            "model": "tiny",
            "tasks": args.tasks,
            "steps": args.steps,
            "kv": {
                "policy": "gkv",
                "budget": kv.budget,
                "interval": kv.interval,
                "window": kv.window,
                "sink": kv.sink,
                **kv.kwargs,
            },
            "acc_gkv": acc_gkv,
            "acc_full_cache": acc_full,
            "rl_sparse_gain_points": round(100 * (acc_gkv["rl_sparse"] - acc_gkv["untrained"]), 2),
            "training": train_stats,
        }
    )


if __name__ == "__main__":
    main()
