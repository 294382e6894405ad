"""G-KV's post-training on the multihop reasoner: RL-Sparse or Distill under the G-KV cache, or
RL-Full with the full cache, judged on held-out tasks against the untrained reasoner under the
same G-KV cache; or RL-Sparse and Distill under a trained ForesightKV scorer, frozen (``joint_rl_sparse``,
``joint_distill``), judged under that scorer against the untrained reasoner under it.

Training is the formulation's recipe (``recipes/tiny_multihop_sparse.yaml``,
``tiny_multihop_distill.yaml`` or ``tiny_multihop_full.yaml``) at ``--budget`` (RL-Full trains with
the full cache at any budget, so its folder is named by the budget it is judged at), into ``--out/<formulation>_<budget>_lr<lr>`` with
``resume=auto``: a stopped run continues where it stopped when the command is given again, and
a finished one is evaluated as it is; a larger ``--steps`` continues it (the rate is constant after the warm-up,
so that is the same run, longer), and each length's model is kept (``model-stepN``) for a smaller ``--steps`` to
judge. Training draws its tasks from seed 0's stream; the
judged tasks are ``--tasks`` tasks of the test stream (seed 9001), which no choice of
reward or hyperparameter looked at; those were made on the validation stream (seed 7001:
``--stream validation``, and ``benchmarks/learning/multihop_signal.py``). Both models decode greedily under G-KV at the
RL-Sparse recipe's interval, window, sink and kwargs (the joint formulations: under their own recipe's
scorer, ``kv.kwargs.run``, at ``--budget``: train it first with ``benchmarks/learning/multihop_foresight_seeds.py``);
accuracy is the exact answer with its 95 % Wilson interval, query accuracy beside it.

Prints one JSON line and writes it to ``benchmarks/results/multihop_<formulation>[_<budget>].json``
(no suffix at the recipe's budget) with the commit it ran at. ``cpu_split`` is each training
step's mean wall seconds in rollout and learner (Ray actors' CPU is not this process's).

    python benchmarks/learning/multihop_gkv.py --formulation rl_sparse [--steps 60] [--tasks 256]
    python benchmarks/learning/multihop_gkv.py --formulation joint_rl_sparse   # after multihop_foresight_seeds.py
"""

import argparse
import json
import shutil
from pathlib import Path

from kvrl.algos.rl_sparse import RLSparse
from kvrl.bench import (
    TEST_SEED,
    VALIDATION_SEED,
    accuracy,
    column_mean,
    draw_tasks,
    emit,
    reasoner,
    record,
    streams,
    timed,
    train_commits,
)
from kvrl.config import load_config
from kvrl.eval.budgets import evaluate
from kvrl.jobs.rl import main as train
from kvrl.runlog import setup_process

RECIPES = {
    "rl_sparse": "tiny_multihop_sparse",
    "distill": "tiny_multihop_distill",
    "rl_full": "tiny_multihop_full",
    "joint_rl_sparse": "tiny_multihop_joint_sparse",
    "joint_distill": "tiny_multihop_joint_distill",
}
JUDGE = "tiny_multihop_sparse"  # whose G-KV cache the others are judged under; a learned-scorer recipe: its own


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formulation", choices=sorted(RECIPES), required=True)
    ap.add_argument("--budget", type=int, default=None, help="kv.budget (default: the recipe's)")
    ap.add_argument("--steps", type=int, default=None, help="trainer.steps (default: the recipe's)")
    ap.add_argument("--lr", type=float, default=None, help="trainer.lr (default: the recipe's)")
    ap.add_argument(
        "--stream",
        choices=["validation", "test"],
        default="test",
        help="judge on the validation stream (choices; printed, not recorded) or the test stream",
    )
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--out", default="outputs/multihop_gkv")
    ap.add_argument(
        "--scorer",
        default=None,
        help="joint formulations: the ForesightKV run whose scorer is the cache (give each its own --out)",
    )
    args = ap.parse_args()
    setup_process()

    recipe = load_config([f"recipe={RECIPES[args.formulation]}"])
    judge = RECIPES[args.formulation] if recipe.kv.policy == "learned" else JUDGE
    scorer = [f"kv.kwargs.run={args.scorer}"] if args.scorer else []
    if scorer and recipe.kv.policy != "learned":
        raise SystemExit(f"--scorer is for the joint formulations; {args.formulation} evicts with {recipe.kv.policy}")
    kv = load_config([f"recipe={judge}", *scorer]).kv
    budget = args.budget or kv.budget
    steps = args.steps or recipe.trainer.steps
    lr = args.lr or recipe.trainer.lr
    seed = {"validation": VALIDATION_SEED, "test": TEST_SEED}[args.stream]
    out = Path(args.out) / f"{args.formulation}_{budget}_lr{lr:.0e}".replace("e-0", "e-")
    overrides = [
        f"recipe={RECIPES[args.formulation]}",
        *scorer,
        *([] if recipe.kv.policy == "full" else [f"kv.budget={budget}"]),
        f"trainer.steps={steps}",
        f"trainer.lr={lr}",
        f"output_dir={out}",
        "resume=auto",
    ]

    # ---- train (or continue, or reuse a finished run)
    cfg = load_config(overrides)
    metrics = out / "metrics.jsonl"
    done = (out / "model").is_dir() and metrics.exists() and len(metrics.read_text().splitlines()) >= steps
    _, train_wall, _ = timed(lambda: None if done else train(cfg))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    # a run continued to more steps (constant rate after warm-up: the same run, longer) keeps each length's model
    model_at = out / f"model-step{len(records)}"
    if not model_at.exists():
        shutil.copytree(out / "model", model_at)
    model_at = out / f"model-step{steps}"
    if not model_at.exists():
        raise SystemExit(f"{out} has trained past step {steps} and kept no model at it; judge --steps {len(records)}")
    records = records[:steps]

    # ---- judge both models greedily under the same cache (G-KV, or the joint recipe's scorer), on the test stream
    env, tasks = draw_tasks(cfg.env.id, args.tasks, seed)  # partial_credit 0: the exact answer
    judging = RLSparse(
        load_config([f"recipe={judge}", f"kv.budget={budget}", *scorer])
    )  # its rollout policy is the cache
    judged = {}
    for name, path in {"untrained": cfg.model.path, "trained": str(model_at)}.items():
        model, _, engine = reasoner(path)
        policy = judging.rollout_policy(model)
        judged[name] = accuracy(evaluate(engine, env, tasks, cfg.sampling.max_new_tokens, policy=policy))

    first, last = records[:5], records[-5:]
    name = f"multihop_{args.formulation}" + ("" if budget == kv.budget else f"_{budget}")
    line = {
        "benchmark": "multihop_gkv",
        "formulation": args.formulation,
        "task": "multihop",
        "model": cfg.model.path,
        "kv": {
            "policy": kv.policy,
            "budget": budget,
            "interval": kv.interval,
            "window": kv.window,
            "sink": kv.sink,
            **kv.kwargs,
        },
        "budget": budget,
        "trained_cache": cfg.kv.policy,
        "trained_acc": judged["trained"]["acc"],
        "trained_ci95": judged["trained"]["ci95"],
        "trained_query_acc": judged["trained"].get("query_acc"),
        "baseline": "untrained" + (f", under the scorer of {kv.kwargs['run']}" if kv.policy == "learned" else ""),
        "baseline_acc": judged["untrained"]["acc"],
        "baseline_ci95": judged["untrained"]["ci95"],
        "baseline_query_acc": judged["untrained"].get("query_acc"),
        "gain_points": round(100 * (judged["trained"]["acc"] - judged["untrained"]["acc"]), 2),
        "stream": args.stream,
        "tasks": args.tasks,
        **streams(seed, cfg.seed, train_commits(out)),
        "training": {
            "steps": len(records),
            "samples": records[-1]["samples_total"],
            "lr": cfg.trainer.lr,
            "temperature": cfg.sampling.temperature,
            "reward": dict(cfg.env.kwargs),
            "reward_first5": column_mean(first, "reward_mean"),
            "reward_last5": column_mean(last, "reward_mean"),
            "correct_first5": column_mean(first, "env/correct"),
            "correct_last5": column_mean(last, "env/correct"),
            "query_acc_first5": column_mean(first, "env/query_acc"),
            "query_acc_last5": column_mean(last, "env/query_acc"),
            "zero_std_groups_mean": column_mean(records, "zero_std_groups"),
            "mismatch_max": max(r["mismatch_max"] for r in records),  # over every step's tokens
            "wall_s_this_call": round(train_wall, 1),
        },
        "cpu_split": {
            "rollout_s": column_mean(records, "rollout_s"),
            "learn_s": column_mean(records, "learn_s"),
            "step_s": column_mean(records, "step_s"),
            "gen_tokens_per_s": column_mean(records, "gen_tokens_per_s"),
        },
    }
    record(name, line) if args.stream == "test" else emit(line)


if __name__ == "__main__":
    main()
