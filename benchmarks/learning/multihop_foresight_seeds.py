"""ForesightKV on the multihop reasoner over training seeds: what each stage buys, at 25 and 50 % of the sequence.

For each training budget B of ``--trained`` (default 117 and 235: 25 and 50 % of the ~470-token sequences) and each
seed S of ``--seeds``, trains ``python -m kvrl.run recipe=tiny_multihop_foresight kv.budget=B seed=S`` into
``--runs``/bB-sS (a stopped run resumes when the command is given again; a finished one is judged as it is). The
seed draws the traces, the scorer's initialisation, the SFT batches and the stage-2 episodes. No choice looked at
any stream: the recipe's settings are tiny_foresight's.

Every run's stage-1 (SFT) and stage-2 (RL) scorers are judged at every budget of ``--judged`` (default: those
trained at): greedy exact accuracy on ``--tasks`` tasks of the test stream (seed 9001), HF engine, interval 16,
window 8, sink 4 (the zoo's setting), beside every rule-based policy there. Prints one JSON line per training
budget and records it in ``benchmarks/results/multihop_foresight_seeds_B.json``: ``trained_acc`` is the RL scorer's
mean over seeds with Student's t interval over them (:func:`kvrl.bench.mean_interval`), ``baseline_acc`` the best
rule-based policy at B; each seed's accuracy, SFT's beside RL's, and the scorers judged at the other budgets.

A judged accuracy is kept in the run's (or, for the zoo, ``--runs``') ``judged.json`` under the judging commit,
the number of tasks and the budget: given again at the same clean commit, the command judges only what is new (a
seed added, a run finished since), so seeds can be judged as their runs finish.

``--rerun S`` also trains stage 2 of seed S at the first trained budget a second time from the same stage 1 (its
traces, Golden replays and SFT scorer copied), and reports whether the two stage-2 scorers are bitwise equal and
their accuracies: a run is reproducible from its seed on one machine (``tests/test_foresight_seeds.py``). Each seed's
line also says what its stage 2 did (``stage2_per_seed``: :func:`stage2_line`)::

    python benchmarks/learning/multihop_foresight_seeds.py [--seeds 0,1,2] [--trained 117,235] [--rerun 0]
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from kvrl.bench import (
    ROOT,
    TEST_SEED,
    accuracy,
    column_mean,
    dirty_files,
    draw_tasks,
    emit,
    mean_interval,
    reasoner,
    record,
    streams,
    train_commits,
)
from kvrl.config import load_config
from kvrl.eval.budgets import evaluate
from kvrl.eval.suite import PolicySpec
from kvrl.policies import RULE_BASED, make_policy
from kvrl.runlog import setup_process

RECIPE = "tiny_multihop_foresight"
RULES = ("window", *RULE_BASED)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=ints, default=[0, 1, 2])
    ap.add_argument("--trained", type=ints, default=[117, 235], help="the budgets the scorers are trained at")
    ap.add_argument("--judged", type=ints, default=None, help="the budgets they are judged at (default --trained)")
    ap.add_argument("--runs", default="outputs/multihop_foresight/seeds")
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--rerun", type=int, default=None, metavar="SEED", help="train stage 2 of SEED a second time")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override of every run trained")
    ap.add_argument("--no-record", action="store_true", help="print the lines, write no results file")
    args = ap.parse_args()
    setup_process()  # one torch thread, denormals flushed: as every kvrl process
    runs = Path(args.runs)
    judged = args.judged or args.trained

    # ---- train every (budget, seed) not yet finished; a rerun of one seed's stage 2 from its stage 1
    folders = {(b, s): train(runs, b, s, args.set) for s in args.seeds for b in args.trained}
    rerun = None
    if args.rerun is not None:
        rerun = (args.trained[0], args.rerun)
        folders["rerun"] = train(runs, *rerun, args.set, again=folders[rerun])

    # ---- judge: the zoo once per budget, every run's two scorers at every judged budget
    cfg = load_config([f"recipe={RECIPE}"])
    kv, new_tokens = cfg.kv, cfg.sampling.max_new_tokens
    model, _, engine = reasoner(cfg.model.path)
    model.requires_grad_(False)
    env, tasks = draw_tasks(cfg.env.id, args.tasks, TEST_SEED)
    schedule = {"interval": kv.interval, "window": kv.window, "sink": kv.sink, "budget_ratio": None}
    cache = Judged(len(tasks))
    full = cache.get(runs, "full", lambda: evaluate(engine, env, tasks, new_tokens))
    zoo, scorers = {}, {}
    for budget in judged:
        for name in RULES:
            policy = PolicySpec.of(name, {}).regime(model.config, budget, schedule)
            zoo.setdefault(name, {})[budget] = cache.get(
                runs, f"{name}@{budget}", lambda: evaluate(engine, env, tasks, new_tokens, policy=policy)
            )
        for key, folder in folders.items():
            for stage in ("sft", "rl"):
                policy = make_policy(
                    "learned", model.config, budget=budget, interval=kv.interval, window=kv.window, sink=kv.sink
                )
                policy.load_scorer(folder / stage / "scorer.safetensors")
                r = cache.get(
                    folder, f"{stage}@{budget}", lambda: evaluate(engine, env, tasks, new_tokens, policy=policy)
                )
                scorers.setdefault(key, {}).setdefault(stage, {})[budget] = r

    # ---- one line per training budget
    write = emit if args.no_record else None
    for trained_at in args.trained:
        keys = [(trained_at, s) for s in args.seeds]
        best = max(RULES, key=lambda n: zoo[n][trained_at]["acc"]) if trained_at in judged else None
        stages = {
            stage: {
                budget: {
                    "per_seed": [scorers[k][stage][budget]["acc"] for k in keys],
                    **mean_interval([scorers[k][stage][budget]["acc"] for k in keys], len(tasks)),
                }
                for budget in judged
            }
            for stage in ("sft", "rl")
        }
        rl = stages["rl"][trained_at]
        line = {
            "benchmark": "multihop_foresight_seeds",
            "formulation": "foresight",
            "task": "multihop",
            "model": cfg.model.path,
            "recipe": RECIPE,
            "kv": {"interval": kv.interval, "window": kv.window, "sink": kv.sink, "trained_at_budget": trained_at},
            "budget": trained_at,
            "trained": "ForesightKV stage-2 (RL) scorer, mean over training seeds",
            "trained_acc": rl["mean"],
            "trained_ci95": rl["ci95"],
            "baseline": f"best rule-based policy at {trained_at}: {best}",
            "baseline_acc": zoo[best][trained_at]["acc"],
            "baseline_ci95": zoo[best][trained_at]["ci95"],
            "seeds": args.seeds,
            "stages": stages,  # judged budget -> per-seed accuracies and their mean with interval
            "stage2_gain_points_per_seed": [
                round(100 * (a - b), 2) for a, b in zip(rl["per_seed"], stages["sft"][trained_at]["per_seed"])
            ],
            "per_seed": {s: scorers[(trained_at, s)] for s in args.seeds},
            "stage2_per_seed": {s: stage2_line(folders[(trained_at, s)], cfg) for s in args.seeds},
            "zoo": {n: {b: zoo[n][b] for b in judged} for n in RULES},
            "full": full,
            "n": len(tasks),
            "tasks": len(tasks),
            **streams(TEST_SEED, args.seeds, {s: train_commits(folders[(trained_at, s)]) for s in args.seeds}, None),
            "minutes_per_seed": [
                round(json.loads((folders[k] / "results.json").read_text())["minutes"], 1) for k in keys
            ],
        }
        if rerun and rerun[0] == trained_at:
            line["rerun"] = rerun_line(folders[rerun], folders["rerun"], rerun[1], scorers[rerun], scorers["rerun"])
        (write or (lambda x, b=trained_at: record(f"multihop_foresight_seeds_{b}", x)))(line)


class Judged:
    """Accuracies judged on ``tasks`` test tasks, kept in a folder's ``judged.json`` under the commit that judged
    them; a dirty tree neither reads nor writes them (its line would name code that did not run)."""

    def __init__(self, tasks: int):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        self.prefix = None if dirty_files(ROOT) or not commit else f"{commit.strip()}/{TEST_SEED}/{tasks}/"

    def get(self, folder: Path, key: str, judge) -> dict:
        path = folder / "judged.json"
        kept = json.loads(path.read_text()) if path.exists() else {}
        if self.prefix and self.prefix + key in kept:
            return kept[self.prefix + key]
        result = accuracy(judge())
        if self.prefix:
            path.write_text(json.dumps({**kept, self.prefix + key: result}, indent=1) + "\n")
        return result


def train(runs: Path, budget: int, seed: int, overrides: list[str], again: Path | None = None) -> Path:
    """The finished run of ``budget`` and ``seed`` (trained here unless it is); ``again``: a second stage 2 of
    that finished run, from a copy of its traces, Golden replays and stage-1 scorer."""
    out = runs / (f"b{budget}-s{seed}" + ("-rerun" if again else ""))
    if (out / "results.json").exists():
        return out
    for part in ("traces", "golden", "sft") if again else ():  # a rerun starts from the same stage 1
        if not (out / part).exists():
            shutil.copytree(again / part, out / part)
    cmd = [sys.executable, "-m", "kvrl.run", f"recipe={RECIPE}", f"kv.budget={budget}", f"seed={seed}"]
    subprocess.run([*cmd, *overrides, f"output_dir={out}", "resume=auto"], check=True)
    return out


def stage2_line(run: Path, cfg) -> dict:
    """What stage 2 did in ``run``, from its files: the mean share of GRPO groups with no reward spread, the mean
    gradient norm before clipping (``cfg``'s ``trainer.max_grad_norm`` beside it), the mean KL to the stage-1 scorer, how
    far the weights moved (the norm of the change over the stage-1 weights' norm), and the pipeline's own
    held-out check (64 tasks of the training stream, not the test stream) of both stages."""
    rows = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    sft, rl = (load_file(run / stage / "scorer.safetensors") for stage in ("sft", "rl"))
    moved = sum(float((rl[k] - sft[k]).pow(2).sum()) for k in sft) ** 0.5
    size = sum(float(sft[k].pow(2).sum()) for k in sft) ** 0.5
    heldout = json.loads((run / "results.json").read_text())["accuracy"]
    return {
        "zero_std_groups": column_mean(rows, "zero_std_groups"),
        "grad_norm": column_mean(rows, "grad_norm", 1),
        "max_grad_norm": cfg.trainer.max_grad_norm,
        "kl_to_stage1": column_mean(rows, "kl", 8),
        "relative_weight_change": round(moved / size, 4),
        "heldout_acc": {stage: round(heldout[f"foresight_{stage}"]["accuracy"], 4) for stage in ("sft", "rl")},
    }


def rerun_line(first: Path, second: Path, seed: int, judged_first: dict, judged_second: dict) -> dict:
    """Whether a second stage 2 from the same stage 1 gave the same scorer, and both scorers' accuracies."""
    a, b = (load_file(f / "rl" / "scorer.safetensors") for f in (first, second))
    differ = [k for k in a if not a[k].equal(b[k])]
    return {
        "seed": seed,
        "stage2_scorers_bitwise_equal": not differ,
        "tensors_that_differ": len(differ),
        "rl": {budget: [judged_first["rl"][budget]["acc"], r["acc"]] for budget, r in judged_second["rl"].items()},
    }


if __name__ == "__main__":
    main()
