"""A G-KV post-training formulation on the multihop reasoner, longer, its rate, length and sampling temperature
chosen on the validation stream.

For each rate of ``--lrs`` and temperature of ``--temperatures`` trains ``--formulation``'s recipe (default
RL-Sparse, ``tiny_multihop_sparse``: G-KV at 235, partial credit; a joint formulation under ``--scorer``) for the
largest of ``--lengths`` steps, one length after another (``benchmarks/learning/multihop_gkv.py --steps N``: each
longer run continues the shorter one and keeps its model), and judges each (rate, temperature, length) greedily on
``--validation-tasks`` tasks of the validation stream (seed 7001). The candidate with the most exact answers there
(ties: the shorter, then the lower rate, then the recipe's temperature) is judged once on the 256 test tasks (seed
9001) by ``multihop_gkv.py``, which records ``benchmarks/results/multihop_<formulation>.json``; this script records
the choice beside it in ``multihop_<formulation>_choice.json``: every validation accuracy, what was chosen, and the
test line's figures. No test task is looked at before the choice is made.

``--recorded`` adds the candidates of an earlier choice file (their validation accuracies as recorded, at the
commits that file names) to the choice, so new candidates compete with the earlier ones without retraining them;
if an earlier candidate is still the best, its recorded test figures stand and no test task is judged again.

    python benchmarks/learning/multihop_gkv_choice.py [--lrs 1e-4,3e-4] [--lengths 40,80,120]
    python benchmarks/learning/multihop_gkv_choice.py --lrs 3e-4 --lengths 40,80 --temperatures 0.7 \
        --recorded benchmarks/results/multihop_rl_sparse_choice.json
    python benchmarks/learning/multihop_gkv_choice.py --formulation joint_distill \
        --scorer outputs/multihop_foresight/seeds/b117-s0 --out outputs/multihop_gkv/joint_distill
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from multihop_gkv import RECIPES  # this script's folder is on the path

from kvrl.bench import VALIDATION_SEED, record
from kvrl.config import load_config

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
    ap.add_argument("--temperatures", default=None, help="sampling temperatures (default: the recipe's)")
    ap.add_argument("--recorded", default=None, help="an earlier choice file whose candidates compete too")
    ap.add_argument("--validation-tasks", type=int, default=128)
    ap.add_argument("--out", default="outputs/multihop_gkv")
    args = ap.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    lengths = sorted(int(x) for x in args.lengths.split(","))
    common = [f"--formulation={args.formulation}", f"--out={args.out}"]
    if args.scorer:
        common.append(f"--scorer={args.scorer}")
    earlier = json.loads(Path(args.recorded).read_text()) if args.recorded else None
    if earlier and (earlier["formulation"], earlier["validation_tasks"]) != (args.formulation, args.validation_tasks):
        raise SystemExit(
            f"{args.recorded} chose {earlier['formulation']} on {earlier['validation_tasks']} validation tasks; "
            f"give --formulation {earlier['formulation']} --validation-tasks {earlier['validation_tasks']}"
        )
    recipe_temperature = load_config([f"recipe={RECIPES[args.formulation]}"]).sampling.temperature
    temperatures = [float(x) for x in args.temperatures.split(",")] if args.temperatures else [recipe_temperature]

    # ---- every (rate, temperature, length) on the validation stream
    table = {}
    for temperature in temperatures:
        for lr in lrs:
            for steps in lengths:
                flags = [f"--lr={lr}", f"--steps={steps}", f"--temperature={temperature}"]
                line = judged(*common, *flags, "--stream=validation", f"--tasks={args.validation_tasks}")
                row = {
                    "lr": lr,
                    "steps": steps,
                    "temperature": temperature,
                    "acc": line["trained_acc"],
                    "ci95": line["trained_ci95"],
                    "query_acc": line["trained_query_acc"],
                    "untrained_acc": line["baseline_acc"],
                }
                suffix = "" if temperature == recipe_temperature else f"_t{temperature:g}"
                table[f"lr{lr:g}_steps{steps}{suffix}"] = row
                print(json.dumps(row), file=sys.stderr, flush=True)
    for key, row in (earlier["validation"] if earlier else {}).items():
        # a candidate judged again now keeps today's figures; a recorded one names the commit that judged it
        table.setdefault(key, {"temperature": recipe_temperature, **row, "recorded": earlier["commit"]})
    chosen = max(
        table.values(),
        key=lambda r: (r["acc"], -r["steps"], -r["lr"], r["temperature"] == recipe_temperature),
    )

    # ---- the chosen one, once, on the test stream (multihop_gkv.py records its own line), unless recorded already
    if chosen.get("recorded"):
        assert (chosen["lr"], chosen["steps"]) == (earlier["chosen"]["lr"], earlier["chosen"]["steps"]), chosen
        print(f"{args.recorded}'s choice is still the best on validation: its test figures stand", file=sys.stderr)
        test = {**earlier, "tasks": earlier["n"]}
    else:
        flags = [f"--lr={chosen['lr']}", f"--steps={chosen['steps']}", f"--temperature={chosen['temperature']}"]
        test = judged(*common, *flags, "--stream=test")
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
            "chosen": {"lr": chosen["lr"], "steps": chosen["steps"], "temperature": chosen["temperature"]},
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
