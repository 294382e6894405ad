"""The main job's table over training seeds: what ForesightKV buys on the counts reasoner, with its spread.

Runs ``python -m kvrl.run recipe=tiny_foresight seed=S`` for each ``--seeds`` S into ``--out``/seed_S (a
run that stopped resumes when the command is given again; a finished one, with its ``results.json``, is
read as it is). The seed draws the traces, the scorer's initialisation, the stage-2 rollouts and the 64
held-out tasks, so the spread is the job's as a user reruns it. Prints one JSON line and records it in
``benchmarks/results/main_job_seeds.json``: every policy's greedy accuracy at each seed and the mean over
seeds with Student's t interval over them (:func:`kvrl.bench.mean_interval`); ``trained_acc`` is the RL
scorer's mean, ``baseline_acc`` the best rule-based policy's by mean.

    python benchmarks/learning/main_job_seeds.py [--seeds 0,1,2]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvrl.bench import mean_interval, record, train_commits
from kvrl.policies import RULE_BASED

RECIPE = "tiny_foresight"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="outputs/main_job_seeds")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    results, minutes = {}, {}
    for seed in seeds:
        out = Path(args.out) / f"seed_{seed}"
        start = time.perf_counter()
        if not (out / "results.json").exists():
            cmd = [sys.executable, "-m", "kvrl.run", f"recipe={RECIPE}", f"seed={seed}", f"output_dir={out}"]
            subprocess.run(cmd, check=True)
        results[seed] = json.loads((out / "results.json").read_text())
        minutes[seed] = round(results[seed]["minutes"], 1)
        print(f"seed {seed}: {time.perf_counter() - start:.0f} s this call", file=sys.stderr)

    tasks = {r["accuracy"]["foresight_rl"]["tasks"] for r in results.values()}
    assert len(tasks) == 1, f"the seeds' runs judged different numbers of tasks: {tasks}"
    n = tasks.pop()
    names = sorted({name for r in results.values() for name in r["accuracy"]})
    policies = {}
    for name in names:
        accs = [results[s]["accuracy"][name]["accuracy"] for s in seeds]
        policies[name] = {"per_seed": [round(a, 4) for a in accs], **mean_interval(accs, n)}
    best = max(RULE_BASED, key=lambda name: policies[name]["mean"])
    setting = results[seeds[0]]["setting"]
    line = {
        "benchmark": "main_job_seeds",
        "task": "counts",
        "formulation": "foresight",
        "recipe": RECIPE,
        "budget": setting["budget"],
        "setting": setting,
        "trained": "ForesightKV RL scorer (mean over seeds)",
        "trained_acc": policies["foresight_rl"]["mean"],
        "trained_ci95": policies["foresight_rl"]["ci95"],
        "baseline": f"best rule-based by mean ({best})",
        "baseline_acc": policies[best]["mean"],
        "baseline_ci95": policies[best]["ci95"],
        "policies": policies,
        "loss_ratio_rl": [round(results[s]["loss_ratio"]["foresight_rl"], 4) for s in seeds],
        "n": n,
        "seeds": seeds,
        "train_commits": {seed: train_commits(Path(args.out) / f"seed_{seed}") for seed in seeds},
        "minutes_per_seed": minutes,
    }
    record("main_job_seeds", line)


if __name__ == "__main__":
    main()
