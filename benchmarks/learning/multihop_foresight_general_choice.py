"""ForesightKV's budget-general scorer on the multihop reasoner: its range of training budgets and its stage chosen
on the validation stream.

For each range ``lo-hi`` of ``--ranges`` (fractions of each trace's length; default 0.2-0.8 and 0.15-0.6, which
reaches below the tightest budget judged) trains ``tiny_multihop_foresight_general``
with ``foresight.budgets=[lo,hi]`` into ``--out/budgets<lo>-<hi>`` (resumable, by ``multihop_foresight.py``'s
pipeline), and judges both of its stages greedily, unchanged, on ``--validation-tasks`` tasks of the validation
stream (seed 7001) at every budget of ``--budgets``. The (range, stage) with the highest mean exact accuracy over
those budgets (ties: the earlier range, then stage 2) is judged once on the 256 test tasks (seed 9001) by
``multihop_foresight.py --recipe tiny_multihop_foresight_general --stage S``, which records
``benchmarks/results/multihop_foresight_general_<B>.json`` (one line per budget, beside the budget-specific scorers
in ``--specific`` and the zoo); this script records the choice in
``benchmarks/results/multihop_foresight_general_choice.json``: every validation accuracy and what was chosen. No
test task is looked at to make the choice.

    python benchmarks/learning/multihop_foresight_general_choice.py [--ranges 0.2-0.8,0.15-0.6]
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from kvrl.bench import VALIDATION_SEED, accuracy, draw_tasks, reasoner, record, train_commits
from kvrl.config import load_config
from kvrl.eval.budgets import evaluate
from kvrl.jobs.foresight import main as train
from kvrl.policies import make_policy
from kvrl.runlog import setup_process

RECIPE = "tiny_multihop_foresight_general"
JUDGE = Path(__file__).with_name("multihop_foresight.py")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranges", default="0.2-0.8,0.15-0.6")
    ap.add_argument("--budgets", default="117,176,235,352")
    ap.add_argument("--validation-tasks", type=int, default=128)
    ap.add_argument("--out", default="outputs/multihop_foresight/general_choice")
    ap.add_argument("--specific", default="outputs/multihop_foresight/seeds", help="the budget-specific runs")
    args = ap.parse_args()
    setup_process()
    ranges = [tuple(float(x) for x in r.split("-")) for r in args.ranges.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]

    # ---- train each range (or reuse its finished run)
    runs = {}
    for lo, hi in ranges:
        out = runs[(lo, hi)] = Path(args.out) / f"budgets{lo:g}-{hi:g}"
        cfg = load_config([f"recipe={RECIPE}", f"foresight.budgets=[{lo},{hi}]", f"output_dir={out}", "resume=auto"])
        if not (out / "results.json").exists():
            train(cfg)

    # ---- both stages of each on the validation stream, at every budget (the ranges share every other setting)
    model, _, engine = reasoner(cfg.model.path)
    model.requires_grad_(False)
    env, tasks = draw_tasks(cfg.env.id, args.validation_tasks, VALIDATION_SEED)
    kv = cfg.kv
    table = {}
    for (lo, hi), out in runs.items():
        for stage in ("rl", "sft"):
            acc = {}
            for budget in budgets:
                scorer = make_policy(
                    "learned", model.config, budget=budget, interval=kv.interval, window=kv.window, sink=kv.sink
                )
                scorer.load_scorer(out / stage / "scorer.safetensors")
                acc[str(budget)] = accuracy(evaluate(engine, env, tasks, cfg.sampling.max_new_tokens, policy=scorer))
            row = {"range": [lo, hi], "stage": stage, "mean_acc": statistics.fmean(a["acc"] for a in acc.values())}
            table[f"budgets{lo:g}-{hi:g}_{stage}"] = {**row, "accuracy": acc, "train_commits": train_commits(out)}
            print(json.dumps(row), file=sys.stderr, flush=True)
    chosen = max(table.values(), key=lambda r: r["mean_acc"])  # max keeps the first of equals: earlier range, rl

    # ---- the choice, recorded before any test task is looked at
    lo, hi = chosen["range"]
    record(
        "multihop_foresight_general_choice",
        {
            "benchmark": "multihop_foresight_general_choice",
            "formulation": "foresight_general",
            "task": "multihop",
            "recipe": RECIPE,
            "budgets": budgets,
            "chosen": {"range": [lo, hi], "stage": chosen["stage"], "mean_acc": chosen["mean_acc"]},
            "validation": table,
            "validation_tasks": args.validation_tasks,
            "validation_seed": VALIDATION_SEED,
            "test_results": [f"benchmarks/results/multihop_foresight_general_{b}.json" for b in budgets],
        },
    )

    # ---- the chosen one, once, on the test stream (multihop_foresight.py records its lines)
    subprocess.run(
        [
            sys.executable,
            str(JUDGE),
            f"--recipe={RECIPE}",
            f"--out={runs[(lo, hi)]}",
            f"--specific={args.specific}",
            f"--budgets={args.budgets}",
            f"--stage={chosen['stage']}",
            "--chosen",
            f"--set=foresight.budgets=[{lo},{hi}]",
        ],
        check=True,
    )


if __name__ == "__main__":
    main()
