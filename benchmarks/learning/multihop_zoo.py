"""The policy zoo on the multihop reasoner's test stream, and each trained formulation's picture over it.

Evaluates ``recipes/tiny_multihop_eval.yaml``'s policies (the full cache, sink + recent, StreamingLLM,
H2O, SnapKV, R-KV, G-KV, built as job=eval builds them) greedily on the same ``--tasks`` tasks of the
test stream (seed 9001) that ``multihop_gkv.py`` judges its trained models on, at every budget its
results files hold (``benchmarks/results/multihop_<formulation>[_<budget>].json``) or ``--budgets``.
Prints one JSON line (each policy's exact accuracy with its 95 % Wilson interval and its query accuracy
at each budget) and records it in ``benchmarks/results/multihop_zoo.json``.

Then draws, for each formulation with a results file, accuracy against budget: the zoo's lines in grey,
the untrained reasoner under G-KV and the trained one in colour, each point with its 95 % interval, the
full cache as a reference line; into ``--pictures`` (``docs/img/multihop_<formulation>.png``).

    python benchmarks/learning/multihop_zoo.py [--tasks 256] [--budgets 117,235]
    python benchmarks/learning/multihop_zoo.py --redraw   # the pictures from the recorded zoo, after a new result
"""

import argparse
import json
from pathlib import Path

from kvrl.bench import TEST_SEED, accuracy, draw_tasks, error_bars, reasoner, record, save_figure
from kvrl.config import load_config
from kvrl.eval.budgets import evaluate
from kvrl.eval.suite import PolicySpec
from kvrl.runlog import pyplot, setup_process

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
COLOURS = {"rl_sparse": "tab:red", "distill": "tab:blue", "rl_full": "tab:green"}


def trained_results() -> dict[str, list[dict]]:
    """formulation -> its results lines (one per budget), sorted by budget: those judged under G-KV, the zoo's
    setting (a joint formulation's are judged under its learned scorer, which the zoo's lines are not)."""
    found: dict[str, list[dict]] = {}
    for path in sorted(RESULTS.glob("multihop_*.json")):
        line = json.loads(path.read_text())
        if line.get("benchmark") == "multihop_gkv" and line.get("stream") == "test" and line["kv"]["policy"] == "gkv":
            found.setdefault(line["formulation"], []).append(line)
    return {k: sorted(v, key=lambda r: r["budget"]) for k, v in found.items()}


def draw(formulation: str, lines: list[dict], zoo: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    budgets = zoo["budgets"]
    markers = iter("sv^<>dph")
    for name, row in zoo["policies"].items():
        if name == "full":
            ax.axhline(row["-"]["acc"], color="black", lw=0.8, ls=":", label=f"full cache ({row['-']['acc']:.3f})")
            continue
        xs = [b for b in budgets if str(b) in row]
        ax.plot(xs, [row[str(b)]["acc"] for b in xs], color="0.55", lw=0.8, marker=next(markers), ms=4, label=name)
    colour = COLOURS.get(formulation, "tab:purple")
    for key, label, style in (("baseline", "untrained, G-KV", "--"), ("trained", f"{formulation}, G-KV", "-")):
        points = [{"acc": r[f"{key}_acc"], "ci95": r[f"{key}_ci95"]} for r in lines]
        ys, err = [p["acc"] for p in points], error_bars(points)
        ax.errorbar(
            [r["budget"] for r in lines], ys, yerr=err, color=colour, ls=style, marker="o", capsize=3, label=label
        )
    ax.set_xlabel("KV budget (tokens; the full cache's mean sequence is ~470)")
    ax.set_ylabel("exact accuracy, 95 % interval")
    ax.set_title(f"multihop reasoner, {lines[0]['tasks']} test tasks: {formulation} over the zoo", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    save_figure(fig, path)


def measure(args, results: dict) -> dict:
    """Every zoo line at every budget on the test stream, as job=eval builds them; recorded."""
    budgets = sorted(
        {int(b) for b in args.budgets.split(",")}
        if args.budgets
        else {r["budget"] for lines in results.values() for r in lines}
    )
    if not budgets:
        raise SystemExit("no multihop_gkv results in benchmarks/results/ and no --budgets: say which budgets")
    cfg = load_config(["recipe=tiny_multihop_eval"])
    env, tasks = draw_tasks(cfg.env.id, args.tasks, TEST_SEED)
    model, _, engine = reasoner(cfg.model.path)
    kv = {"interval": cfg.kv.interval, "window": cfg.kv.window, "sink": cfg.kv.sink, "budget_ratio": None}
    policies = {}
    for name in cfg.eval.policies:
        spec = PolicySpec.of(name, cfg.eval.settings)
        policies[name] = {
            "-" if point is None else str(point): accuracy(
                evaluate(engine, env, tasks, cfg.sampling.max_new_tokens, policy=spec.regime(model.config, point, kv))
            )
            for point in spec.points(budgets)
        }
    zoo = {
        "benchmark": "multihop_zoo",
        "task": "multihop",
        "model": cfg.model.path,
        "stream": "test",
        "tasks": args.tasks,
        "test_seed": TEST_SEED,
        "kv": kv,
        "budgets": budgets,
        "policies": policies,
    }
    record("multihop_zoo", zoo)
    return zoo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--budgets", default=None, help="comma-separated token budgets (default: the results files')")
    ap.add_argument("--pictures", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--redraw", action="store_true", help="draw from benchmarks/results/multihop_zoo.json only")
    args = ap.parse_args()
    setup_process()

    results = trained_results()
    zoo = json.loads((RESULTS / "multihop_zoo.json").read_text()) if args.redraw else measure(args, results)

    # ---- a picture per formulation: its trained line over the zoo's
    for formulation, lines in results.items():
        draw(formulation, lines, zoo, Path(args.pictures) / f"multihop_{formulation}.png")


if __name__ == "__main__":
    main()
