"""G-KV's post-training on the multihop reasoner: RL-Sparse or Distill under the G-KV cache, or
RL-Full with the full cache, judged on held-out tasks against the untrained reasoner under the
same G-KV cache; or RL-Sparse and Distill under a trained ForesightKV scorer, frozen (``joint_rl_sparse``,
``joint_distill``), judged under that scorer against the untrained reasoner under it.

Training is the formulation's recipe (``recipes/tiny_multihop_sparse.yaml``,
``tiny_multihop_distill.yaml`` or ``tiny_multihop_full.yaml``) at ``--budget`` (RL-Full trains with
the full cache at any budget, so its folder is named by the budget it is judged at), into
``--out/<formulation>_<budget>_lr<lr>`` (``_t<T>`` added for rollouts at another ``--temperature`` than the
recipe's, ``_<credit>`` for another ``--credit``) with ``resume=auto``: a stopped run continues where it stopped when the command is given again, and
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
(no suffix at the recipe's budget; ``--name`` names another, for a joint run under another scorer) with the
commit it ran at. ``cpu_split`` is each training
step's mean wall seconds in rollout and learner (Ray actors' CPU is not this process's).

    python benchmarks/learning/multihop_gkv.py --formulation rl_sparse [--steps 60] [--temperature 0.7] [--credit segment] [--tasks 256]
    python benchmarks/learning/multihop_gkv.py --formulation joint_rl_sparse   # after multihop_foresight_seeds.py

``--stop-on-validation 10,20,30,40`` stops each run early: it trains to 40 steps and judges the model it held at
each of those lengths (``model-stepN``, or the checkpoint at N) on ``--validation-tasks`` tasks of the validation
stream; the length with the most exact answers (ties: the fewer steps) is the one judged on the test stream, the
validation figures beside it in ``stopped_on_validation``. ``--kl``: ``rl.kl_coef`` (folder ``_kl<β>``); ``--batch``:
``trainer.batch_size``, samples a step (folder ``_b<N>``; ``--micro-batch-tokens`` bounds the learner's memory).

``--seeds 0,1,2`` trains and judges the formulation once per training seed (each into its folder, ``_sN`` added
but for the recipe's own seed; a joint formulation's ``--scorer`` then names each seed's scorer with ``{seed}``)
and records one line, ``..._seeds.json``: both accuracies' means with Student's t intervals over the seeds
(:func:`kvrl.bench.mean_interval`) and each seed's line in ``per_seed``::

    python benchmarks/learning/multihop_gkv.py --formulation joint_distill --seeds 0,1,2 \
        --scorer outputs/multihop_foresight/seeds/b117-s{seed}
"""

import argparse
import json
import shutil
import statistics
from pathlib import Path

from kvrl.algos.rl_sparse import RLSparse
from kvrl.bench import (
    TEST_SEED,
    VALIDATION_SEED,
    accuracy,
    column_mean,
    draw_tasks,
    emit,
    mean_interval,
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--formulation", choices=sorted(RECIPES), required=True)
    ap.add_argument("--budget", type=int, default=None, help="kv.budget (default: the recipe's)")
    ap.add_argument("--steps", type=int, default=None, help="trainer.steps (default: the recipe's)")
    ap.add_argument("--lr", type=float, default=None, help="trainer.lr (default: the recipe's)")
    ap.add_argument(
        "--temperature", type=float, default=None, help="sampling.temperature of the rollouts (default: the recipe's)"
    )
    ap.add_argument(
        "--credit",
        choices=["sequence", "segment"],
        default=None,
        help="rl.credit: what a token's advantage rewards (default: the recipe's)",
    )
    ap.add_argument("--kl", type=float, default=None, help="rl.kl_coef (default: the recipe's)")
    ap.add_argument(
        "--batch", type=int, default=None, help="trainer.batch_size, samples per step (default: the recipe's)"
    )
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="trainer.micro_batch_tokens: the learner's padded tokens per backward, to bound its memory under a "
        "larger --batch (the same gradient: not in the folder's name)",
    )
    ap.add_argument(
        "--stop-on-validation",
        default=None,
        metavar="L1,L2,...",
        help="early stopping: train to the largest of these steps, judge the model at each on --validation-tasks "
        "tasks of the validation stream and judge the one with the most exact answers (ties: fewer steps) on the "
        "test stream; per seed under --seeds",
    )
    ap.add_argument("--validation-tasks", type=int, default=128)
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
        help="joint formulations: the ForesightKV run whose scorer is the cache (give each its own --out); "
        "with --seeds, a path holding {seed}, each seed's scorer",
    )
    ap.add_argument(
        "--name",
        default=None,
        help="the results file's name (default multihop_<formulation>[_<budget>][_seeds]): a joint run under "
        "another scorer keeps its own file",
    )
    ap.add_argument(
        "--seeds", default=None, help="comma-separated training seeds (default: the recipe's); several: one line"
    )
    args = ap.parse_args(argv)
    recipe = load_config([f"recipe={RECIPES[args.formulation]}"])
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [recipe.seed]
    if args.scorer and recipe.kv.policy != "learned":
        raise SystemExit(f"--scorer is for the joint formulations; {args.formulation} evicts with {recipe.kv.policy}")
    if len(seeds) > 1 and args.scorer and "{seed}" not in args.scorer:
        raise SystemExit(
            f"--seeds {args.seeds} trains under each seed's own scorer: give --scorer a path with {{seed}} in it, "
            "e.g. --scorer outputs/multihop_foresight/seeds/b117-s{seed}"
        )
    if args.stop_on_validation and (args.steps or args.stream == "validation"):
        raise SystemExit(
            "--stop-on-validation chooses the length on the validation stream and judges it on the test stream: "
            "drop --steps and --stream"
        )
    setup_process()
    judge = RECIPES[args.formulation] if recipe.kv.policy == "learned" else JUDGE
    default_budget = load_config([f"recipe={judge}"]).kv.budget
    budget = args.budget or default_budget
    lines = [train_and_judge(args, recipe, judge, budget, seed) for seed in seeds]
    line = lines[0] if len(lines) == 1 else over_seeds(lines)
    name = f"multihop_{args.formulation}" + ("" if budget == default_budget else f"_{budget}")
    name += "_seeds" if len(lines) > 1 else ""
    name = args.name or name
    record(name, line) if args.stream == "test" else emit(line)


def train_and_judge(args, recipe, judge: str, budget: int, seed: int) -> dict:
    """Trains (or continues, or reuses) the formulation at one training seed and judges it under ``judge``'s
    cache at ``budget``: its results line."""
    scorer = [f"kv.kwargs.run={args.scorer.format(seed=seed)}"] if args.scorer else []
    kv = load_config([f"recipe={judge}", *scorer]).kv
    lengths = sorted(int(n) for n in args.stop_on_validation.split(",")) if args.stop_on_validation else []
    steps = lengths[-1] if lengths else args.steps or recipe.trainer.steps
    lr = args.lr or recipe.trainer.lr
    temperature = args.temperature or recipe.sampling.temperature
    credit = args.credit or recipe.rl.credit
    kl = recipe.rl.kl_coef if args.kl is None else args.kl
    batch = args.batch or recipe.trainer.batch_size
    stream_seed = {"validation": VALIDATION_SEED, "test": TEST_SEED}[args.stream]
    folder = f"{args.formulation}_{budget}_lr{lr:.0e}".replace("e-0", "e-")
    folder += "" if temperature == recipe.sampling.temperature else f"_t{temperature:g}"
    folder += "" if credit == recipe.rl.credit else f"_{credit}"
    folder += "" if kl == recipe.rl.kl_coef else f"_kl{kl:g}"
    folder += "" if batch == recipe.trainer.batch_size else f"_b{batch}"
    folder += "" if seed == recipe.seed else f"_s{seed}"
    out = Path(args.out) / folder
    overrides = [
        f"recipe={RECIPES[args.formulation]}",
        *scorer,
        *([] if recipe.kv.policy == "full" else [f"kv.budget={budget}"]),
        f"trainer.steps={steps}",
        f"trainer.lr={lr}",
        f"sampling.temperature={temperature}",
        f"rl.credit={credit}",
        f"rl.kl_coef={kl}",
        f"trainer.batch_size={batch}",
        *([f"trainer.micro_batch_tokens={args.micro_batch_tokens}"] if args.micro_batch_tokens else []),
        f"seed={seed}",
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
    judging = RLSparse(
        load_config([f"recipe={judge}", f"kv.budget={budget}", *scorer])
    )  # its rollout policy is the cache

    def judged_on(path, drawn) -> dict:
        """Greedy accuracy of the reasoner at ``path`` on ``drawn`` (an env and its tasks), under the judging cache."""
        env, tasks = drawn
        model, _, engine = reasoner(str(path))
        return accuracy(evaluate(engine, env, tasks, cfg.sampling.max_new_tokens, policy=judging.rollout_policy(model)))

    # ---- early stopping: the length with the most exact answers on the validation stream
    stopped = {}  # the line's "stopped_on_validation", under --stop-on-validation
    if lengths:
        drawn = draw_tasks(cfg.env.id, args.validation_tasks, VALIDATION_SEED)  # partial_credit 0: the exact answer
        validation = {n: judged_on(kept_model(out, n), drawn) for n in lengths}
        steps = max(lengths, key=lambda n: (validation[n]["acc"], -n))
        stopped["stopped_on_validation"] = {
            "steps": steps,
            "validation_seed": VALIDATION_SEED,
            "validation_tasks": args.validation_tasks,
            "acc": {str(n): v["acc"] for n, v in validation.items()},
            "query_acc": {str(n): v.get("query_acc") for n, v in validation.items()},
        }
    records = records[:steps]

    # ---- judge both models greedily under the same cache (G-KV, or the joint recipe's scorer), on the test stream
    drawn = draw_tasks(cfg.env.id, args.tasks, stream_seed)
    judged = {
        name: judged_on(path, drawn)
        for name, path in {"untrained": cfg.model.path, "trained": kept_model(out, steps)}.items()
    }

    first, last = records[:5], records[-5:]
    return {
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
        "n": args.tasks,
        "tasks": args.tasks,
        **streams(stream_seed, cfg.seed, train_commits(out)),
        "training": {
            "steps": len(records),
            "samples": records[-1]["samples_total"],
            "lr": cfg.trainer.lr,
            "temperature": cfg.sampling.temperature,
            "credit": cfg.rl.credit,
            "kl_coef": cfg.rl.kl_coef,
            "batch_size": cfg.trainer.batch_size,
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
        **stopped,
        "cpu_split": {
            "rollout_s": column_mean(records, "rollout_s"),
            "learn_s": column_mean(records, "learn_s"),
            "step_s": column_mean(records, "step_s"),
            "gen_tokens_per_s": column_mean(records, "gen_tokens_per_s"),
        },
    }


def kept_model(out: Path, steps: int) -> Path:
    """The model a run held after ``steps`` steps: the one kept at the end of a run of that length, or the
    checkpoint's (every rl.checkpoint_every steps)."""
    for path in (out / f"model-step{steps}", out / "checkpoints" / f"step_{steps:06d}" / "model"):
        if path.is_dir():
            return path
    raise SystemExit(
        f"{out} kept no model at step {steps}: judge a length it checkpointed (rl.checkpoint_every) or ended at"
    )


def over_seeds(lines: list[dict]) -> dict:
    """One line for several training seeds: the trained and untrained accuracies' means with Student's t
    interval over the seeds (under a joint formulation each seed has its own scorer, so its own baseline),
    the gain's mean and each seed's line beside."""
    tasks = lines[0]["tasks"]
    trained = mean_interval([x["trained_acc"] for x in lines], tasks)
    baseline = mean_interval([x["baseline_acc"] for x in lines], tasks)
    gains = [x["gain_points"] for x in lines]
    return {
        **{k: v for k, v in lines[0].items() if k not in ("training", "cpu_split", "kv", "stopped_on_validation")},
        "kv": {**lines[0]["kv"], **({"run": [x["kv"]["run"] for x in lines]} if "run" in lines[0]["kv"] else {})},
        "trained": "mean over training seeds",
        "trained_acc": trained["mean"],
        "trained_ci95": trained["ci95"],
        "trained_query_acc": round(statistics.fmean(x["trained_query_acc"] for x in lines), 4),
        "baseline": "untrained"
        + (", each seed's under its own scorer" if lines[0]["kv"]["policy"] == "learned" else ""),
        "baseline_acc": baseline["mean"],
        "baseline_ci95": baseline["ci95"],
        "baseline_query_acc": round(statistics.fmean(x["baseline_query_acc"] for x in lines), 4),
        "gain_points": round(statistics.fmean(gains), 2),
        "gain_points_per_seed": gains,
        "train_seed": [x["train_seed"] for x in lines],
        "train_commits": {str(x["train_seed"]): x["train_commits"] for x in lines},
        "per_seed": lines,
    }


if __name__ == "__main__":
    main()
