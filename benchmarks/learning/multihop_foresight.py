"""ForesightKV on the multihop reasoner: the learned scorer against every rule-based policy and Golden Eviction.

Trains ``recipes/tiny_multihop_foresight.yaml`` into ``--out`` (its pipeline resumes: finished stages are
skipped, a stopped stage 2 continues from its checkpoint; a finished run is judged as it is). The scorer
is trained at budget 235 (50 % of the ~470-token sequences) on the full cache's greedy traces of seed 0's
task stream; no choice was made on any stream (the recipe's settings are tiny_foresight's).

At 25 and 50 % (budgets 117 and 235, interval 16, window 8, sink 4: the zoo's setting), side by side:

* accuracy: greedy decoding, HF engine, of ``--tasks`` tasks of the test stream (seed 9001, as
  ``multihop_gkv.py``) under the stage-1 (SFT) and stage-2 (RL) scorers, every rule-based policy and
  the full cache; the exact answer with its 95 % Wilson interval, query accuracy beside it;
* added NLL: the loss each policy adds per generated token (nats; compressed minus full cache) over
  the run's held-out traces (another task stream, seed 1000003), every policy replayed by the same
  chunked teacher-forced pass, Golden Eviction (an oracle: it sees the future, so it has no accuracy)
  among them.

Prints one JSON line and records it in ``benchmarks/results/multihop_foresight.json``: the goal line is
at 50 % (``trained_acc``: Foresight-RL; ``baseline_acc``: the best rule-based policy there). Draws
``docs/img/multihop_foresight.png``: accuracy and added NLL against budget.

    python benchmarks/learning/multihop_foresight.py [--tasks 256]

One scorer for every budget: ``--recipe tiny_multihop_foresight_general`` (foresight.budgets on) trains the
general scorer into ``--out`` and, for each of ``--budgets`` (default 117, 176, 235, 352: 25 to 75 %), the
budget-specific scorer (this recipe at that kv.budget and the general recipe's seed S, in ``--specific``/bB-sS,
where ``multihop_foresight_seeds.py`` trains its runs; above 235 keeping the traces its eviction MDP can evict
from, foresight.min_tokens = B + interval + 1). Each budget gets one line, recorded in ``benchmarks/results/multihop_foresight_general_B.json``:
``trained_acc`` the general scorer (stage 2, or ``--stage sft``; ``--chosen``: the lines say the range and stage
were chosen on the validation stream, as ``multihop_foresight_general_choice.py`` does), ``baseline_acc`` the
budget-specific one (both stages of each judged), the zoo's best and every accuracy beside them, the added NLL per token of every policy (Golden Eviction's among them) over the
general run's held-out traces, and the commits that trained the runs (``train_commits``) and judged them
(``commit``); draws ``docs/img/multihop_foresight_general.png``. ``--set KEY=VALUE`` overrides every run trained
and ``--no-record`` prints the lines only (a smoke run at tiny sizes)::

    python benchmarks/learning/multihop_foresight.py --recipe tiny_multihop_foresight_general

``--redraw`` draws both pictures again from the recorded results files (no model is run)::

    python benchmarks/learning/multihop_foresight.py --redraw
"""

import argparse
import json
from functools import partial
from pathlib import Path

import numpy as np

from kvrl.algos.foresight import RULE_BASED, loss_ratios
from kvrl.bench import (
    TEST_SEED,
    VALIDATION_SEED,
    accuracy,
    column_mean,
    draw_tasks,
    emit,
    error_bars,
    reasoner,
    record,
    save_figure,
    streams,
    train_commits,
)
from kvrl.config import load_config
from kvrl.data.traces import SPLIT_SEEDS, load_traces
from kvrl.eval.budgets import evaluate
from kvrl.eval.suite import PolicySpec
from kvrl.jobs.foresight import main as train
from kvrl.policies import make_policy
from kvrl.runlog import pyplot, setup_process

RECIPE = "tiny_multihop_foresight"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
BUDGETS = (117, 235)  # 25 and 50 % of the full cache's mean sequence
GENERAL_BUDGETS = (117, 176, 235, 352)  # 25, 37.5, 50 and 75 %
RULES = ("window", *RULE_BASED)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--recipe", default=RECIPE, help="a recipe with foresight.budgets judges one scorer at --budgets")
    ap.add_argument(
        "--budgets", help="comma-separated token budgets to judge at (default 117,235; general 117,...,352)"
    )
    ap.add_argument("--out", default=None, help="the run (default outputs/multihop_foresight/run, or /general)")
    ap.add_argument("--specific", default="outputs/multihop_foresight/seeds", help="where the budget-specific runs go")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override of every run trained")
    ap.add_argument("--no-record", action="store_true", help="print the lines, write no results file")
    ap.add_argument(
        "--stage", choices=["rl", "sft"], default="rl", help="the general scorer's stage each line's trained_acc is"
    )
    ap.add_argument(
        "--chosen",
        action="store_true",
        help="the general run's range and stage were chosen on the validation stream (its lines say so)",
    )
    ap.add_argument("--picture", default="docs/img/multihop_foresight.png")
    ap.add_argument("--redraw", action="store_true", help="draw both pictures from benchmarks/results only")
    args = ap.parse_args()
    if args.redraw:
        return redraw(Path(args.picture))
    setup_process()
    cfg = load_config([f"recipe={args.recipe}", *args.set])
    general = cfg.foresight.budgets is not None
    out = Path(args.out or f"outputs/multihop_foresight/{'general' if general else 'run'}")
    cfg = load_config([f"recipe={args.recipe}", f"output_dir={out}", "resume=auto", *args.set])
    budgets = (
        [int(b) for b in args.budgets.split(",")] if args.budgets else list(GENERAL_BUDGETS if general else BUDGETS)
    )
    write = emit if args.no_record else None
    if general:
        judge_general(args, cfg, out, budgets, write)
    else:
        judge_specific(args, cfg, out, budgets, write)


def trained(cfg, out: Path) -> list[str]:
    """Train ``cfg`` into ``out`` unless finished there (its pipeline resumes a stopped run); the commits that
    trained it (:func:`kvrl.bench.train_commits`)."""
    if not (out / "results.json").exists():
        train(cfg)
    return train_commits(out)


def judge_specific(args, cfg, out: Path, budgets: list[int], write) -> None:
    """The recipe's scorer (stage 1 and 2), trained at kv.budget, against the zoo at ``budgets``."""
    if cfg.kv.budget not in budgets:
        raise SystemExit(f"--budgets must hold the recipe's kv.budget {cfg.kv.budget}: its goal line is there")
    commits = trained(cfg, out)
    run = json.loads((out / "results.json").read_text())
    records = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    sft_rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sft_loss = [r["loss"] for r in sft_rows if r.get("stage") == "sft"]

    model, _, engine = reasoner(cfg.model.path)
    model.requires_grad_(False)
    heldout = load_traces(out / "traces" / "heldout")
    full_per_token = sum(map(sum, (t.loss for t in heldout))) / sum(len(t.loss) for t in heldout)
    env, tasks = draw_tasks(cfg.env.id, args.tasks, TEST_SEED)
    kv = cfg.kv

    # ---- every policy at every budget: accuracy on the test stream, added NLL on the held-out traces
    acc, added = {"full": {"-": accuracy(evaluate(engine, env, tasks, cfg.sampling.max_new_tokens))}}, {}
    for budget in budgets:
        setting = dict(budget=budget, interval=kv.interval, window=kv.window, sink=kv.sink)
        scorers = {}
        for name, stage in (("foresight_sft", "sft"), ("foresight_rl", "rl")):
            scorers[name] = make_policy("learned", model.config, **setting)
            scorers[name].load_scorer(out / stage / "scorer.safetensors")
        # the sink + recent window is a static mask, not a token policy: it has no teacher-forced replay
        ratios = loss_ratios(model, heldout, {"golden": "golden", **scorers, **{n: n for n in RULE_BASED}}, **setting)
        for name, ratio in ratios.items():
            added.setdefault(name, {})[str(budget)] = round((ratio - 1) * full_per_token, 5)
        schedule = {"interval": kv.interval, "window": kv.window, "sink": kv.sink, "budget_ratio": None}
        zoo = {n: PolicySpec.of(n, {}).regime(model.config, budget, schedule) for n in RULES}
        for name, policy in {**zoo, **scorers}.items():
            r = accuracy(evaluate(engine, env, tasks, cfg.sampling.max_new_tokens, policy=policy))
            acc.setdefault(name, {})[str(budget)] = r

    goal = str(kv.budget)
    best = max(RULES, key=lambda n: acc[n][goal]["acc"])
    line = {
        "benchmark": "multihop_foresight",
        "formulation": "foresight",
        "task": "multihop",
        "model": cfg.model.path,
        "kv": {"interval": kv.interval, "window": kv.window, "sink": kv.sink, "trained_at_budget": kv.budget},
        "budget": kv.budget,
        "trained_acc": acc["foresight_rl"][goal]["acc"],
        "trained_ci95": acc["foresight_rl"][goal]["ci95"],
        "baseline": f"best rule-based policy at {kv.budget}: {best}",
        "baseline_acc": acc[best][goal]["acc"],
        "baseline_ci95": acc[best][goal]["ci95"],
        "gain_points": round(100 * (acc["foresight_rl"][goal]["acc"] - acc[best][goal]["acc"]), 2),
        "budgets": budgets,
        "accuracy": acc,
        "added_nll_per_token": added,
        "full_cache_nll_per_token": round(full_per_token, 6),
        "heldout_traces": len(heldout),
        "mean_trace_tokens": round(float(np.mean([len(t.ids) for t in heldout])), 1),
        "tasks": len(tasks),
        # no choice looked at a stream (validation None): the settings are tiny_foresight's
        **streams(TEST_SEED, cfg.seed, commits, validation_seed=None),
        "heldout_trace_seed": cfg.seed + SPLIT_SEEDS["heldout"],
        "training": {
            "traces": cfg.foresight.traces,
            "sft_steps": cfg.foresight.sft_steps,
            "sft_loss_first_last": [round(sft_loss[0], 5), round(sft_loss[-1], 5)] if sft_loss else None,
            "rl_steps": len(records),
            "rl_reward_first5": column_mean(records[:5], "reward_mean", 5),
            "rl_reward_last5": column_mean(records[-5:], "reward_mean", 5),
            "pipeline_minutes": round(run["minutes"], 1),
        },
        # stage 2's mean seconds per step (the other stages: pipeline_minutes)
        "cpu_split": {k: column_mean(records, f"{k}_s", 2) for k in ("rollout", "learn", "step")},
    }
    (write or partial(record, "multihop_foresight"))(line)
    if not write:
        draw(line, Path(args.picture))


def specific_run(args, budget: int, seed: int) -> tuple:
    """(config, folder) of the budget-specific scorer at ``budget``: this recipe at that kv.budget, keeping the
    traces its eviction MDP evicts from where the budget is above the recipe's (long enough for all of it)."""
    base = load_config([f"recipe={RECIPE}"])
    out = Path(args.specific) / f"b{budget}-s{seed}"
    longer = [f"foresight.min_tokens={budget + base.kv.interval + 1}"] if budget > base.kv.budget else []
    own = [s for s in args.set if not s.startswith("foresight.budgets=")]  # the general run's range, not this one's
    overrides = [f"recipe={RECIPE}", f"kv.budget={budget}", f"seed={seed}", *longer, *own]
    overrides += [f"output_dir={out}", "resume=auto"]
    return load_config(overrides), out


def judge_general(args, cfg, out: Path, budgets: list[int], write) -> None:
    """The one scorer of a recipe with foresight.budgets at each of ``budgets``, unchanged, beside the
    budget-specific scorer trained at that budget and the zoo: one line per budget."""
    commits = {"general": trained(cfg, out)}
    specific = {}
    for budget in budgets:
        scfg, specific[budget] = specific_run(args, budget, cfg.seed)
        commits[f"specific_{budget}"] = trained(scfg, specific[budget])
    model, _, engine = reasoner(cfg.model.path)
    model.requires_grad_(False)
    env, tasks = draw_tasks(cfg.env.id, args.tasks, TEST_SEED)
    kv, new_tokens = cfg.kv, cfg.sampling.max_new_tokens
    full = accuracy(evaluate(engine, env, tasks, new_tokens))
    heldout = load_traces(out / "traces" / "heldout")
    full_per_token = sum(map(sum, (t.loss for t in heldout))) / sum(len(t.loss) for t in heldout)
    lines = []
    for budget in budgets:
        setting = dict(budget=budget, interval=kv.interval, window=kv.window, sink=kv.sink)
        scorers = {}
        for name, run, stage in (
            ("foresight_general_sft", out, "sft"),
            ("foresight_general_rl", out, "rl"),
            ("foresight_specific_sft", specific[budget], "sft"),
            ("foresight_specific_rl", specific[budget], "rl"),
        ):
            scorers[name] = make_policy("learned", model.config, **setting)
            scorers[name].load_scorer(run / stage / "scorer.safetensors")
        schedule = {"interval": kv.interval, "window": kv.window, "sink": kv.sink, "budget_ratio": None}
        zoo = {n: PolicySpec.of(n, {}).regime(model.config, budget, schedule) for n in RULES}
        acc = {"full": full}
        for name, policy in {**zoo, **scorers}.items():
            acc[name] = accuracy(evaluate(engine, env, tasks, new_tokens, policy=policy))
        best = max(RULES, key=lambda n: acc[n]["acc"])
        general, specialist = acc[f"foresight_general_{args.stage}"], acc["foresight_specific_rl"]
        policies = {"golden": "golden", **scorers, **{n: n for n in RULE_BASED}}
        added = {
            n: round((r - 1) * full_per_token, 5) for n, r in loss_ratios(model, heldout, policies, **setting).items()
        }
        line = {
            "benchmark": "multihop_foresight_general",
            "formulation": "foresight_general",
            "task": "multihop",
            "model": cfg.model.path,
            "recipe": args.recipe,
            "kv": {"interval": kv.interval, "window": kv.window, "sink": kv.sink},
            "trained_budget_fractions": list(cfg.foresight.budgets),
            "trained_stage": args.stage,
            "budget": budget,
            "trained_acc": general["acc"],
            "trained_ci95": general["ci95"],
            "baseline": f"the budget-specific ForesightKV scorer ({RECIPE} at kv.budget={budget}, stage 2)",
            "baseline_acc": specialist["acc"],
            "baseline_ci95": specialist["ci95"],
            "gain_points": round(100 * (general["acc"] - specialist["acc"]), 2),
            "zoo_best": best,
            "zoo_best_acc": acc[best]["acc"],
            "zoo_best_ci95": acc[best]["ci95"],
            "accuracy": acc,
            "added_nll_per_token": added,  # over the general run's held-out traces, Golden Eviction's beside
            "full_cache_nll_per_token": round(full_per_token, 6),
            "n": len(tasks),
            "tasks": len(tasks),
            "heldout_traces": len(heldout),
            **streams(
                TEST_SEED,
                cfg.seed,
                {"general": commits["general"], "specific": commits[f"specific_{budget}"]},
                validation_seed=VALIDATION_SEED if args.chosen else None,
            ),
            "heldout_trace_seed": cfg.seed + SPLIT_SEEDS["heldout"],
        }
        (write or partial(record, f"multihop_foresight_general_{budget}"))(line)
        lines.append(line)
    if not write:
        draw_general(lines, Path(args.picture))


def redraw(path: Path) -> None:
    """Both pictures again from the latest recorded lines: ``multihop_foresight.json`` and the general scorer's
    ``multihop_foresight_general_B.json``, one per judged budget."""
    draw(json.loads((RESULTS / "multihop_foresight.json").read_text()), path)
    draw_general(
        [json.loads((RESULTS / f"multihop_foresight_general_{b}.json").read_text()) for b in GENERAL_BUDGETS], path
    )


def draw_general(lines: list[dict], path: Path) -> None:
    """The general scorer's picture, beside ``path``, from its lines (one per judged budget)."""
    full = lines[0]["accuracy"]["full"]
    picture = {
        "budgets": [line["budget"] for line in lines],
        "accuracy": {"full": {"-": full}},
        "added_nll_per_token": {},
    }
    for line in lines:
        for key in ("accuracy", "added_nll_per_token"):
            for name, value in line[key].items():
                if name != "full":
                    picture[key].setdefault(name, {})[str(line["budget"])] = value
    # lines recorded before they held their count of held-out traces: the title goes without it
    picture.update(tasks=lines[0]["tasks"], heldout_traces=lines[0].get("heldout_traces"))
    draw(picture, path.with_name("multihop_foresight_general.png"), "one scorer for every budget")


def draw(line: dict, path: Path, title: str | None = None) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 5.5))
    xs = line["budgets"]
    markers = iter("sv^<>dph")
    colours = {
        "foresight_rl": "tab:red",
        "foresight_sft": "tab:pink",
        "golden": "black",
        "foresight_general_rl": "tab:blue",
        "foresight_general_sft": "tab:cyan",
        "foresight_specific_rl": "tab:red",
        "foresight_specific_sft": "tab:pink",
    }
    for name, row in line["accuracy"].items():
        if name == "full":
            a.axhline(row["-"]["acc"], color="black", lw=0.8, ls=":", label=f"full cache ({row['-']['acc']:.3f})")
            continue
        points = [row[str(x)] for x in xs]
        ys = [p["acc"] for p in points]
        if name in colours:
            a.errorbar(xs, ys, yerr=error_bars(points), color=colours[name], marker="o", capsize=3, label=name)
        else:
            a.plot(xs, ys, color="0.55", lw=0.8, marker=next(markers), ms=4, label=name)
    a.set_xlabel("KV budget (tokens; the full cache's mean sequence is ~470)")
    a.set_ylabel("exact accuracy, 95 % interval")
    a.set_title(f"{line['tasks']} test tasks, greedy", fontsize=9)
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)  # below: lines fill the axes
    markers = iter("sv^<>dph")
    for name, row in line["added_nll_per_token"].items():
        ys = [max(row[str(x)], 1e-6) for x in xs]
        style = dict(color=colours[name], marker="o") if name in colours else dict(color="0.55", marker=next(markers))
        b.plot(xs, ys, lw=1, ms=4, label=name, **style)
    b.set_yscale("log")
    b.set_xlabel("KV budget (tokens)")
    b.set_ylabel("added NLL per generated token (nats)")
    traces = f"{line['heldout_traces']} held-out traces" if line.get("heldout_traces") else "held-out traces"
    b.set_title(f"{traces}, teacher-forced", fontsize=9)
    b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)
    title = title or f"ForesightKV (trained at {line['budget']})"
    fig.suptitle(f"multihop reasoner: {title} over the zoo", fontsize=10)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
