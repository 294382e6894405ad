"""A G-KV post-training formulation on the multihop reasoner, longer, its rate and length chosen on the
validation stream.

For each rate of ``--lrs`` trains ``--formulation``'s recipe (default RL-Sparse, ``tiny_multihop_sparse``: G-KV at
235, partial credit; a joint formulation under ``--scorer``) for the largest of ``--lengths`` steps, one length
after another (``benchmarks/learning/multihop_gkv.py --steps N``: each longer run continues the shorter one and
keeps its model), and judges each (rate, length) greedily on ``--validation-tasks`` tasks of the validation stream
(seed 7001). The (rate, length) with the most exact answers there (ties: the shorter, then the lower rate) is
judged once on the 256 test tasks (seed 9001) by ``multihop_gkv.py``, which records
``benchmarks/results/multihop_<formulation>.json``; this script records the choice beside it in
``multihop_<formulation>_choice.json``: every validation accuracy, what was chosen, and the test line's figures.
No test task is looked at before the choice is made.

    python benchmarks/learning/multihop_gkv_choice.py [--lrs 1e-4,3e-4] [--lengths 40,80,120]
    python benchmarks/learning/multihop_gkv_choice.py --formulation joint_distill \
        --scorer outputs/multihop_foresight/seeds/b117-s0 --out outputs/multihop_gkv/joint_distill
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvrl.bench import VALIDATION_SEED, record

GKV = Path(__file__).with_name("multihop_gkv.py")


def judged(*args: str) -> dict:
    """The JSON line multihop_gkv.py prints for ``args`` (it trains what is missing first)."""
    out = subprocess.run([sys.executable, str(GKV), *args], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formulation", default="rl_sparse", help="one of multihop_gkv.py's formulations")
    ap.add_argument("--scorer", default=None, help="joint formulations: the ForesightKV run whose scorer is the cache")
    ap.add_argument("--lrs", default="1e-4,3e-4")
    ap.add_argument("--lengths", default="40,80,120")
    ap.add_argument("--validation-tasks", type=int, default=128)
    ap.add_argument("--out", default="outputs/multihop_gkv")
    args = ap.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    lengths = sorted(int(x) for x in args.lengths.split(","))
    common = [f"--formulation={args.formulation}", f"--out={args.out}"]
    if args.scorer:
        common.append(f"--scorer={args.scorer}")

    # ---- every (rate, length) on the validation stream
    table = {}
    for lr in lrs:
        for steps in lengths:
            line = judged(
                *common, f"--lr={lr}", f"--steps={steps}", "--stream=validation", f"--tasks={args.validation_tasks}"
            )
            table[f"lr{lr:g}_steps{steps}"] = {
                "lr": lr,
                "steps": steps,
                "acc": line["trained_acc"],
                "ci95": line["trained_ci95"],
                "query_acc": line["trained_query_acc"],
                "untrained_acc": line["baseline_acc"],
            }
            print(json.dumps(table[f"lr{lr:g}_steps{steps}"]), file=sys.stderr, flush=True)
    chosen = max(table.values(), key=lambda r: (r["acc"], -r["steps"], -r["lr"]))

    # ---- the chosen one, once, on the test stream (multihop_gkv.py records its own line)
    test = judged(*common, f"--lr={chosen['lr']}", f"--steps={chosen['steps']}", "--stream=test")
    record(
        f"multihop_{args.formulation}_choice",
        {
            "benchmark": "multihop_gkv_choice",
            "formulation": args.formulation,
            "task": "multihop",
            "budget": test["budget"],
            "kv": test["kv"],
            "trained_acc": test["trained_acc"],
            "trained_ci95": test["trained_ci95"],
            "baseline": test["baseline"],
            "baseline_acc": test["baseline_acc"],
            "baseline_ci95": test["baseline_ci95"],
            "gain_points": test["gain_points"],
            "n": test["tasks"],
            "tasks": test["tasks"],
            "chosen": {"lr": chosen["lr"], "steps": chosen["steps"]},
            "validation": table,
            "validation_tasks": args.validation_tasks,
            "validation_seed": VALIDATION_SEED,
            "stream_seed": test["stream_seed"],
            "train_seed": test["train_seed"],
            "test_seed": test["test_seed"],
            "train_commits": test["train_commits"],
            "training": test["training"],
        },
    )


if __name__ == "__main__":
    main()
