"""RLKV on the multihop reasoner: does its head ranking beat random heads and an attention statistic?

Trains ``recipes/tiny_multihop_rlkv.yaml`` into ``--out`` (``resume=auto``: a stopped run continues
when the command is given again; a finished one, with its ``gates.safetensors``, is judged as it is).
Training draws its tasks from seed 0's stream. Then every head allocation decodes the same ``--tasks``
tasks of the test stream (seed 9001, as ``multihop_gkv.py``) greedily on the head-reallocated vLLM
engine, with round(s·L·H) of the model's (layer, KV head) pairs compressed to the recipe's deployment
window (16 sink + 64 recent) at each sparsity s, the heads chosen:

* by RLKV's gates (lowest compressed first);
* at random (``--draws`` uniform draws; their mean, and each draw);
* by an attention statistic, DuoAttention-style: the attention mass each head's window would lose (keys
  outside the sink and the recent window), averaged over the full cache's greedy sequences of
  ``--stat-tasks`` tasks of the validation stream (seed 7001); the heads that lose least are compressed
  first. It looks at no test task.

Prints one JSON line and records it in ``benchmarks/results/multihop_rlkv.json``; the goal line is at
sparsity 0.5 (``trained_acc``: RLKV's heads; ``baseline_acc``: the random draws' mean over distinct head
sets, its interval Student's t over those sets). Draws ``docs/img/multihop_rlkv.png``: accuracy against
sparsity.

    python benchmarks/learning/multihop_rlkv.py [--tasks 256] [--draws 8]
    python benchmarks/learning/multihop_rlkv.py --restate   # the baselines again from the recorded draws
"""

import argparse
import json
import os
from pathlib import Path

import torch

from kvrl.bench import (
    TEST_SEED,
    VALIDATION_SEED,
    accuracy,
    column_mean,
    draw_tasks,
    error_bars,
    mean_interval,
    record,
    save_figure,
    streams,
    train_commits,
)
from kvrl.config import load_config
from kvrl.eval.budgets import evaluate
from kvrl.jobs.rlkv import main as train
from kvrl.models.tiny import load_model, resolve_path
from kvrl.policies.heads import head_allocation, load_gates
from kvrl.runlog import pyplot, setup_process

RECIPE = "tiny_multihop_rlkv"
SPARSITIES = (0.25, 0.5, 0.75)


def window_loss(model, sequences: list[list[int]], sink: int, recent: int) -> torch.Tensor:
    """[layers, KV heads] mean attention mass outside ``sink`` + ``recent`` per query, over every
    position of ``sequences`` (query heads averaged within their KV group)."""
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    total = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, dtype=torch.float64)
    count = 0
    for ids in sequences:
        T = len(ids)
        t = torch.arange(T)
        # key j is lost to query t when sink <= j <= t - recent (the window keeps the token itself)
        lost = (t[None, :] >= sink) & (t[None, :] <= t[:, None] - recent)
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
        for layer, att in enumerate(out.attentions):  # [1, heads, T, T]
            mass = (att[0] * lost).sum(-1).mean(-1)  # [heads]
            total[layer] += mass.double().view(cfg.num_key_value_heads, group).mean(-1)
        count += 1
    return (total / count).float()


def random_heads(accs: list[float], heads: list[list], tasks: int) -> dict:
    """The random baseline from its draws' accuracies and compressed heads: the mean over the *distinct* head
    sets with Student's t interval over them (a set drawn twice counts once; the tasks under one set are
    not independent trials, so they are not pooled)."""
    distinct = {json.dumps(h): a for h, a in zip(heads, accs)}
    over = mean_interval(list(distinct.values()), tasks)
    return {"acc": over["mean"], "ci95": over["ci95"], "sets": over["n"], "draws": accs, "heads": heads}


def restate(path: Path) -> None:
    """Rewrite the recorded line's random baselines from its recorded draws (no model is run): what was
    measured keeps its commit and date as ``measured_commit`` / ``measured_date``."""
    line = json.loads(path.read_text())
    for row in line["sparsities"].values():
        row["random"] = random_heads(row["random"]["draws"], row["random"]["heads"], line["tasks"])
    goal = line["sparsities"]["0.5"]
    line.update(
        baseline=f"random heads ({len(goal['random']['draws'])} draws, mean over {goal['random']['sets']} distinct sets)",
        baseline_acc=goal["random"]["acc"],
        baseline_ci95=goal["random"]["ci95"],
        gain_points=round(100 * (goal["rlkv"]["acc"] - goal["random"]["acc"]), 2),
        measured_commit=line.pop("measured_commit", line.pop("commit")),
        measured_date=line.pop("measured_date", line.pop("date")),
    )
    line.pop("dirty_files", None)
    record("multihop_rlkv", line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--draws", type=int, default=8, help="random head sets per sparsity")
    ap.add_argument("--stat-tasks", type=int, default=64, help="validation tasks of the attention statistic")
    ap.add_argument("--out", default="outputs/multihop_rlkv/rlkv")
    ap.add_argument("--picture", default="docs/img/multihop_rlkv.png")
    ap.add_argument("--restate", action="store_true", help="recompute the random baselines from the recorded draws")
    args = ap.parse_args()
    if args.restate:
        restate(Path(__file__).resolve().parents[1] / "results" / "multihop_rlkv.json")
        draw(
            json.loads((Path(__file__).resolve().parents[1] / "results" / "multihop_rlkv.json").read_text()),
            Path(args.picture),
        )
        return
    setup_process()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvrl.engines.vllm import VLLMEngine

    # ---- train (or continue, or reuse a finished run)
    out = Path(args.out)
    cfg = load_config([f"recipe={RECIPE}", f"output_dir={out}", "resume=auto"])
    if not (out / "gates.safetensors").exists():
        train(cfg)
    gates = load_gates(out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sink, recent, tokens = cfg.rlkv.eval_sink, cfg.rlkv.eval_recent, cfg.sampling.max_new_tokens
    engine = VLLMEngine(resolve_path(cfg.model.path), dtype="float32", seed=0)

    # ---- the attention statistic, on the full cache's greedy sequences of validation tasks
    model, _ = load_model(cfg.model.path, attn_implementation="eager")
    venv, vtasks = draw_tasks(cfg.env.id, args.stat_tasks, VALIDATION_SEED)
    gen = evaluate(engine, venv, vtasks, tokens)
    prompts = engine.encode([t.prompt for t in vtasks])
    stat = window_loss(model, [p + c for p, c in zip(prompts, gen["tokens"])], sink, recent)

    # ---- every allocation on the test stream
    env, tasks = draw_tasks(cfg.env.id, args.tasks, TEST_SEED)
    n = len(tasks)

    def judge(policy) -> dict:
        return accuracy(evaluate(engine, env, tasks, tokens, policy=policy))

    def heads(scores: torch.Tensor, s: float):
        return head_allocation(scores, s, model.config, sink=sink, recent=recent)

    rng = torch.Generator().manual_seed(TEST_SEED)
    rows = {}
    for s in SPARSITIES:
        ranked = {"rlkv": heads(gates, s), "attention": heads(stat, s)}
        draws = [heads(torch.rand(gates.shape, generator=rng), s) for _ in range(args.draws)]
        rows[str(s)] = {
            "compressed": int(ranked["rlkv"].compressed_mask().sum()),
            **{k: {**judge(a), "heads": a.compressed_mask().nonzero().tolist()} for k, a in ranked.items()},
            "random": random_heads(
                [judge(d)["acc"] for d in draws], [d.compressed_mask().nonzero().tolist() for d in draws], n
            ),
        }
    full = judge(None)["acc"]

    goal = rows["0.5"]
    first, last = records[:5], records[-5:]
    line = {
        "benchmark": "multihop_rlkv",
        "formulation": "rlkv",
        "task": "multihop",
        "model": cfg.model.path,
        "budget": f"sparsity 0.5: half the heads keep {sink} sink + {recent} recent tokens",
        "sparsity": 0.5,
        "window": {"sink": sink, "recent": recent},
        "heads": int(gates.numel()),
        "trained_acc": goal["rlkv"]["acc"],
        "trained_ci95": goal["rlkv"]["ci95"],
        "baseline": f"random heads ({args.draws} draws, mean over {goal['random']['sets']} distinct sets)",
        "baseline_acc": goal["random"]["acc"],
        "baseline_ci95": goal["random"]["ci95"],
        "gain_points": round(100 * (goal["rlkv"]["acc"] - goal["random"]["acc"]), 2),
        "full_acc": full,
        "sparsities": rows,
        "gates": [[round(v, 4) for v in row] for row in gates.tolist()],
        "window_loss": [[round(v, 4) for v in row] for row in stat.tolist()],
        "tasks": n,
        **streams(TEST_SEED, cfg.seed, train_commits(out)),
        "training": {
            "steps": len(records),
            "reward_first5": column_mean(first, "reward_mean"),
            "reward_last5": column_mean(last, "reward_mean"),
            "gate_mean_last": records[-1].get("gate_mean"),
        },
        "cpu_split": {k: column_mean(records, f"{k}_s", 2) for k in ("rollout", "learn", "step")},
    }
    record("multihop_rlkv", line)
    draw(line, Path(args.picture))


def draw(line: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [float(s) for s in line["sparsities"]]
    rows = list(line["sparsities"].values())
    for key, label, colour in (
        ("rlkv", "RLKV's gates", "tab:purple"),
        ("attention", "attention statistic (window loss)", "tab:orange"),
        ("random", f"random heads (mean of {len(rows[0]['random']['draws'])})", "0.4"),
    ):
        points = [r[key] for r in rows]
        ax.errorbar(
            xs, [p["acc"] for p in points], yerr=error_bars(points), color=colour, marker="o", capsize=3, label=label
        )
    for x, r in zip(xs, rows):
        ax.scatter([x] * len(r["random"]["draws"]), r["random"]["draws"], color="0.7", s=8, zorder=0)
    ax.axhline(line["full_acc"], color="black", lw=0.8, ls=":", label=f"full cache ({line['full_acc']:.3f})")
    w = line["window"]
    ax.set_xlabel(f"share of (layer, KV head) pairs compressed to {w['sink']} sink + {w['recent']} recent")
    ax.set_ylabel("exact accuracy, 95 % interval")
    ax.set_title(f"multihop reasoner, {line['tasks']} test tasks: RLKV's head ranking", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
