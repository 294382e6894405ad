"""How much RL-Sparse on counts (``recipes/tiny_gkv_sparse.yaml``) depends on its seed, rollout engine and lr.

Trains the recipe (40 steps of 128 samples, or ``--steps``; lr 1e-4, or ``--lr``; G-KV at budget 76,
temperature 2) at each ``--seeds`` with each ``--engines`` rollout engine, and prints one JSON line: per
run, the sampled reward (the training batches' mean reward under G-KV) over the first and the last 5 steps.
The engines sample the same distribution (the tests hold their logprobs equal), so a difference between
them at one seed is the spread of the run itself: another engine draws other samples from the same seed.

With ``--val-tasks N``, each run also saves its model every ``--every`` steps, and each saved model (and
the untrained one) is judged greedily under the recipe's G-KV cache on the first N tasks of the
validation stream (``kvrl.bench.VALIDATION_SEED``, neither a training stream nor a reported test set):
what a setting of the recipe is chosen on. ``--inline`` runs the loop in this process with one learner
(``workers.address=inline``, as ``trl_rl_sparse.py`` does), which on 2 cores is about twice as fast.

    python benchmarks/learning/gkv_sparse_seeds.py [--seeds 0,1,2] [--engines vllm,hf] [--lr 3e-4]
    python benchmarks/learning/gkv_sparse_seeds.py --seeds 10,11 --engines hf --inline --lr 3e-4 \
        --steps 120 --val-tasks 128 --every 40
"""

import argparse
import json
from pathlib import Path

import numpy as np

from kvrl.bench import VALIDATION_SEED, accuracy, draw_tasks, emit, evaluate_under_recipe, timed
from kvrl.config import load_config
from kvrl.jobs.rl import main as train
from kvrl.runlog import setup_process

INLINE = ["workers.address=inline", "workers.learners=1", "workers.backend=ddp"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--engines", default="vllm,hf")
    ap.add_argument("--lr", type=float, default=None, help="trainer.lr (default: the recipe's)")
    ap.add_argument("--steps", type=int, default=None, help="trainer.steps (default: the recipe's)")
    ap.add_argument("--inline", action="store_true", help="the loop in this process, one learner")
    ap.add_argument("--val-tasks", type=int, default=0, help="judge saved models on this many validation tasks")
    ap.add_argument("--every", type=int, default=40, help="save (and judge) the model every this many steps")
    ap.add_argument("--out", default="outputs/gkv_sparse_seeds")
    args = ap.parse_args()
    setup_process()

    def config(seed: int, engine: str, out: Path):
        return load_config(
            [
                "recipe=tiny_gkv_sparse",
                f"seed={seed}",
                f"workers.engine={engine}",
                *([f"trainer.lr={args.lr}"] if args.lr else []),
                *([f"trainer.steps={args.steps}"] if args.steps else []),
                *(INLINE if args.inline else []),
                f"output_dir={out}",
                "resume=never",
                f"rl.checkpoint_every={args.every if args.val_tasks else 0}",
            ]
        )

    cfg = config(0, "hf", Path(args.out))
    judge = None
    if args.val_tasks:
        env, tasks = draw_tasks(cfg.env.id, args.val_tasks, VALIDATION_SEED, **cfg.env.kwargs)

        def judge(path: str) -> dict:
            return accuracy(evaluate_under_recipe(path, cfg, env, tasks))

    untrained = judge(cfg.model.path) if judge else None
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for engine in args.engines.split(","):
            name = (
                f"{engine}_seed{seed}"
                + (f"_lr{args.lr:g}" if args.lr else "")
                + (f"_{args.steps}" if args.steps else "")
            )
            out = Path(args.out) / name
            cfg = config(seed, engine, out)
            _, wall, _ = timed(lambda: train(cfg))
            rewards = [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            run = {
                "seed": seed,
                "engine": engine,
                "reward_first5": round(float(np.mean(rewards[:5])), 3),
                "reward_last5": round(float(np.mean(rewards[-5:])), 3),
                "wall_s": round(wall, 1),
            }
            if judge:
                saved = sorted((out / "checkpoints").glob("step_*"))
                run["val_acc"] = {int(p.name[5:]): judge(str(p / "model")) for p in saved}
            runs.append(run)
    last = [r["reward_last5"] for r in runs]
    line = {
        "benchmark": "gkv_sparse_seeds",
        "recipe": "tiny_gkv_sparse",
        "lr": cfg.trainer.lr,
        "steps": cfg.trainer.steps,
        "runs": runs,
        "reward_last5_min": min(last),
        "reward_last5_max": max(last),
        "runs_that_rose": sum(r["reward_last5"] > r["reward_first5"] for r in runs),
    }
    if judge:
        line |= {"val_seed": VALIDATION_SEED, "val_tasks": args.val_tasks, "val_untrained": untrained}
    emit(line)


if __name__ == "__main__":
    main()
