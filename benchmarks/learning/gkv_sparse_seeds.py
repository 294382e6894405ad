"""How much RL-Sparse on counts (``recipes/tiny_gkv_sparse.yaml``) depends on its seed and rollout engine.

Trains the recipe as it is (40 steps of 128 samples, lr 1e-3 or ``--lr``, G-KV at budget 76, temperature 2) at each
``--seeds`` with each ``--engines`` rollout engine, and prints one JSON line: per run, the sampled reward
(the training batches' mean reward under G-KV) over the first and the last 5 steps. The engines sample
the same distribution (the tests hold their logprobs equal), so a difference between them at one seed is
the spread of the run itself: another engine draws other samples from the same seed.

    python benchmarks/learning/gkv_sparse_seeds.py [--seeds 0,1,2] [--engines vllm,hf] [--lr 3e-4]
"""

import argparse
import json
from pathlib import Path

import numpy as np

from kvrl.bench import emit, timed
from kvrl.config import load_config
from kvrl.jobs.rl import main as train
from kvrl.runlog import setup_process


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--engines", default="vllm,hf")
    ap.add_argument("--lr", type=float, default=None, help="trainer.lr (default: the recipe's 1e-3)")
    ap.add_argument("--out", default="outputs/gkv_sparse_seeds")
    args = ap.parse_args()
    setup_process()

    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for engine in args.engines.split(","):
            out = Path(args.out) / (f"{engine}_seed{seed}" + (f"_lr{args.lr:g}" if args.lr else ""))
            cfg = load_config(
                [
                    "recipe=tiny_gkv_sparse",
                    f"seed={seed}",
                    f"workers.engine={engine}",
                    *([f"trainer.lr={args.lr}"] if args.lr else []),
                    f"output_dir={out}",
                    "resume=never",
                    "rl.checkpoint_every=0",
                ]
            )
            _, wall, _ = timed(lambda: train(cfg))
            rewards = [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            runs.append(
                {
                    "seed": seed,
                    "engine": engine,
                    "reward_first5": round(float(np.mean(rewards[:5])), 3),
                    "reward_last5": round(float(np.mean(rewards[-5:])), 3),
                    "wall_s": round(wall, 1),
                }
            )
    last = [r["reward_last5"] for r in runs]
    emit(
        {
            "benchmark": "gkv_sparse_seeds",
            "recipe": "tiny_gkv_sparse",
            "lr": cfg.trainer.lr,
            "runs": runs,
            "reward_last5_min": min(last),
            "reward_last5_max": max(last),
            "runs_that_rose": sum(r["reward_last5"] > r["reward_first5"] for r in runs),
        }
    )


if __name__ == "__main__":
    main()
