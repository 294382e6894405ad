"""What job=eval writes beside its samples: the console table, ``accuracy.png``, ``error_modes.png``,
``retention.png`` and ``report.md`` (with the kvrl commit and the checksums of what was evaluated).

:func:`report` writes them from the rows of :func:`kvrl.eval.suite.summarise` (one per line and point);
``kvrl/jobs/eval.py`` generates the samples they summarise.
"""

from __future__ import annotations

from pathlib import Path

import torch

import kvrl
from kvrl.eval.suite import LOOP_DISTINCT, LOOP_N, LOOP_WINDOW, MODES, loops_apply, wilson
from kvrl.runlog import atomic, disk_full_names, pyplot


def report(
    cfg,
    env,
    rows: list[dict],
    traces: dict,
    mean_len: float,
    out: Path,
    weights: str,
    props: dict | None,
    evaluated: dict,
) -> None:
    """``accuracy.png``, ``error_modes.png``, ``retention.png`` (when a line evicted) and ``report.md``, into
    ``out``; a full disk names the file being written, as every atomic write does."""
    with disk_full_names(out / "accuracy.png"):
        plot_accuracy(rows, out / "accuracy.png", f"{cfg.model.path} on {cfg.env.id}")
    with disk_full_names(out / "error_modes.png"):
        plot_modes(rows, out / "error_modes.png")
    shown = retention_samples(traces, rows)
    if shown:
        with disk_full_names(out / "retention.png"):
            plot_retention(shown, out / "retention.png")
    # what the environment's own metrics are: the first sentence of each reward function's docstring
    notes = {
        r.name: " ".join((r.fn.__doc__ or "").replace("``", "`").split()).split(". ")[0].rstrip(".")
        or "its reward function has no docstring"
        for r in getattr(env, "rewards", [])
    }
    write_report(
        cfg, rows, mean_len, out, weights, retention=bool(shown), props=props, evaluated=evaluated, notes=notes
    )


def console_line(row: dict, header: bool = False) -> str:
    """One row of the console table (or, with ``header``, its header): the line, its budget, accuracy with
    its 95 % Wilson interval over the tasks, the environment's own metrics, mean generated tokens, KV
    retention and decode tokens/s."""
    metrics = [k for k in row if k.startswith("info/")]
    if header:
        return (
            f"{'policy':<12}{'budget':>8}  {'accuracy [95 % CI]':<19}"
            + "".join(f"  {k[5:]:>9}" for k in metrics)
            + f"  {'gen len':>7}  {'KV kept':>7}  {'tokens/s':>8}"
        )
    lo, hi = wilson(row["accuracy"], row["tasks"])
    return (
        f"{row['policy']:<12}{row['point']:>8}  {row['accuracy']:.3f} [{lo:.2f}, {hi:.2f}] "
        + "".join(f"  {row[k]:>9.3f}" for k in metrics)
        + f"  {row['gen_tokens']:>7.1f}  {row['kv_retention']:>7.0%}  {row['decode_tokens_per_s']:>8.0f}"
    )


def plot_accuracy(rows: list[dict], path: Path, title: str) -> None:
    """Accuracy against one measured quantity for every line, the peak KV tokens a sequence
    held (token budgets, ratio budgets and RLKV sparsities alike), each point labelled with
    its nominal budget, with its 95 % Wilson interval over the tasks (as report.md gives it;
    a line at 16/16 still has one, [0.81, 1]). The full cache is a dashed line over its
    interval's band. Lines are drawn a few points apart sideways, so that lines at the same
    budget (one budget: every line) do not hide each other."""
    from matplotlib.transforms import ScaledTranslation

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    names = list(dict.fromkeys(r["policy"] for r in rows if r["kind"] != "full"))
    for r in rows:
        if r["kind"] == "full":
            lo, hi = wilson(r["accuracy"], r["tasks"])
            ax.axhline(r["accuracy"], color="k", ls="--", lw=1, label=f"full cache (peak {r['peak_kv_tokens']:.0f})")
            ax.axhspan(lo, hi, color="k", alpha=0.08, lw=0)
    for i, name in enumerate(names):
        line = [r for r in rows if r["policy"] == name]
        shift = ScaledTranslation((i - (len(names) - 1) / 2) * 5 / 72, 0, fig.dpi_scale_trans)  # 5 points apart
        x, y = [r["peak_kv_tokens"] for r in line], [r["accuracy"] for r in line]
        ci = [wilson(r["accuracy"], r["tasks"]) for r in line]
        bars = ax.errorbar(
            x,
            y,
            yerr=[[a - lo for a, (lo, _) in zip(y, ci)], [hi - a for a, (_, hi) in zip(y, ci)]],
            marker="o",
            capsize=2,
            label=name,
            transform=ax.transData + shift,
        )
        ax.update_datalim([(xi, v) for xi, (lo, hi) in zip(x, ci) for v in (lo, hi)])  # a shifted artist is not
        for r, xi in zip(line, x):
            ax.annotate(
                r["point"],
                (xi, r["accuracy"]),
                textcoords="offset points",
                xytext=(3 + (i - (len(names) - 1) / 2) * 5, 3),
                fontsize=6,
                color=bars[0].get_color(),
            )
    ax.autoscale_view()
    ax.margins(x=0.08)
    tasks = sorted({r["tasks"] for r in rows})
    ax.set(
        xlabel="peak KV tokens per sequence (measured; labels: nominal budget)", ylabel="accuracy (pass@1)", title=title
    )
    ax.text(
        0.0,
        -0.2,
        f"bars and band: 95 % Wilson interval over {', '.join(map(str, tasks))} tasks; lines drawn "
        "5 points apart sideways so that equal budgets stay visible",
        transform=ax.transAxes,
        fontsize=6,
        va="top",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_modes(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.4 * len(rows)), 4))
    labels = [f"{r['policy']} {r['point']}" for r in rows]
    bottom = [0.0] * len(rows)
    for mode in MODES:
        share = [r[f"mode/{mode}"] for r in rows]
        if all(v is None for v in share):
            ax.bar(labels, [0.0] * len(rows), label=f"{mode} (not applicable: outputs < {LOOP_WINDOW} words)")
            continue
        share = [v or 0.0 for v in share]
        ax.bar(labels, share, bottom=bottom, label=mode)
        bottom = [b + v for b, v in zip(bottom, share)]
    ax.set(ylabel="share of samples", title="error modes")
    ax.tick_params(axis="x", rotation=90, labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def retention_samples(traces: dict, rows: list[dict]) -> list[tuple[str, object, int]]:
    """One recorded sample per line that evicts: (title, trace, prompt length), at the line's
    middle point among those whose samples were generated in this run."""
    shown = []
    for name in dict.fromkeys(r["policy"] for r in rows):
        points = [label for policy, label in traces if policy == name]
        if points:
            label = points[len(points) // 2]
            shown.append((f"{name} at {label}", *traces[name, label]))
    return shown


def plot_retention(shown: list[tuple[str, object, int]], path: Path, layer: int = 0, heads: int = 4) -> None:
    """Per line (a row of panels) and KV head of ``layer`` (up to ``heads``): the key positions
    (x) held at each decoding step (y) of one sample."""
    from matplotlib.patches import Patch

    plt = pyplot()
    cols = min(heads, shown[0][1].full().shape[2])
    fig, axes = plt.subplots(len(shown), cols, figsize=(2.6 * cols, 2.2 * len(shown) + 0.6), squeeze=False)
    for i, (title, trace, prompt_len) in enumerate(shown):
        death = trace.full()[layer, 0].long()  # [H, T]
        T = int(trace.lengths[0])
        q = torch.arange(prompt_len, T)[:, None]
        k = torch.arange(T)[None]
        for h in range(cols):
            held = (k <= q) & (q < death[h, :T][None])
            ax = axes[i, h]
            ax.imshow(
                held.numpy(),
                aspect="auto",
                cmap="Greys",
                vmin=0,
                vmax=1,
                interpolation="nearest",
                extent=(0, T, T, prompt_len),
            )
            ax.set_title(f"{title}: layer {layer}, KV head {h}", fontsize=7)
            ax.tick_params(labelsize=6)
            if i == len(shown) - 1:
                ax.set_xlabel("key position", fontsize=7)
            if h == 0:
                ax.set_ylabel("decoding step", fontsize=7)
    fig.legend(
        handles=[
            Patch(color="black", label="key held in the cache"),
            Patch(facecolor="white", edgecolor="grey", label="evicted, or not yet generated"),
        ],
        loc="lower center",
        ncol=2,
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.5 / (2.2 * len(shown) + 0.6), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The orderings the papers report at equal cache budgets, best first (zoo names), with their setting.
PAPERS = [
    (
        "R-KV (Cai et al. 2025)",
        "R1-Llama-8B / R1-Qwen-14B on AIME24 and MATH-500",
        "R-KV keeps ~100 % of the full cache's accuracy at 10 % of the cache, SnapKV ~60 %",
        ["rkv", "snapkv"],
    ),
    (
        "G-KV (Liao et al. 2025)",
        "R1-Qwen-7B / R1-Llama-8B on AMC23, AIME24, LiveCodeBench",
        "G-KV > R-KV > SnapKV > StreamingLLM at equal budgets (G-KV ~+20 points on AMC23 at 512)",
        ["gkv", "rkv", "snapkv", "streaming"],
    ),
]


def orderings(rows: list[dict]) -> list[str]:
    """Per budget: the zoo best first with 95 % intervals, and each pair the papers order
    (a above b): agrees, reversed (intervals apart), or a tie (intervals overlap)."""
    lines = []
    points = [r["point"] for r in rows if r["budget"] is not None]
    for point in dict.fromkeys(points):
        at = {r["policy"]: r for r in rows if r["point"] == point and r["budget"] is not None}
        ranked = sorted(at.values(), key=lambda r: -r["accuracy"])
        text = f"{ranked[0]['policy']} {ranked[0]['accuracy']:.3f}"
        for above, r in zip(ranked, ranked[1:]):
            text += f" {'>' if r['accuracy'] < above['accuracy'] else '='} {r['policy']} {r['accuracy']:.3f}"
        lines.append(f"- budget {point}: {text}")
        for paper, _, _, order in PAPERS:
            verdicts = []
            for a, b in zip(order, order[1:]):
                if a not in at or b not in at:
                    continue
                (alo, ahi), (blo, bhi) = (wilson(at[x]["accuracy"], at[x]["tasks"]) for x in (a, b))
                verdict = "agrees" if alo > bhi else "reversed" if ahi < blo else "tie"
                verdicts.append(f"{a} > {b}: {verdict}")
            if verdicts:
                lines.append(f"  - {paper}'s order: " + "; ".join(verdicts))
    return lines


PROPERTY_TEXT = {
    "cot_tokens": "chain-of-thought tokens (mean)",
    "cot_share": "share of the sequence that is chain of thought",
    "cot_far_mass": "attention of CoT queries on CoT tokens >= {far} back (re-reading its own conclusions)",
    "prompt_mass": "attention of CoT queries on the prompt",
    "near_mass": "attention of CoT queries on the {far} newest tokens",
    "attention_sparsity": "CoT query-key pairs below 1 % of the query's largest attention weight (G-KV's sparsity)",
    "redundant_keys": "CoT keys with a near-duplicate key (cosine >= {duplicate_cos}, same KV head)",
    "repeated_trigrams": "CoT tokens that end a 3-gram already in the sequence",
    "h2o_recall": "of the {keep:.0%} of tokens the rest of the trace reads most, share in the top by accumulated "
    "attention so far (H2O's score)",
    "recent_recall": "... share among the newest tokens",
    "random_recall": "... share expected of a random choice",
}


def write_report(
    cfg,
    rows: list[dict],
    mean_len: float,
    out: Path,
    weights: str,
    retention: bool,
    props: dict | None = None,
    evaluated: dict | None = None,
    notes: dict | None = None,
) -> None:
    """``out/report.md``: the run's header, the table of ``rows``, the task's properties beside the papers'
    orderings (with ``props``), the pictures, what the columns are and what was evaluated (with ``evaluated``)."""
    ks = [k for k in cfg.eval.pass_k if f"pass@{k}" in rows[0]]
    metrics = [k for k in rows[0] if k.startswith("info/")]
    lines = report_header(cfg, rows, mean_len, weights) + results_table(rows, ks, metrics)
    if props is not None:
        lines += properties_section(rows, props)
    lines += ["", "![accuracy vs budget](accuracy.png)", "", "![error modes](error_modes.png)", ""]
    if retention:
        lines += ["![retention](retention.png)", ""]
    lines += column_notes(cfg, rows, ks, metrics, notes)
    if evaluated is not None:
        lines += evaluated_section(cfg, evaluated)
    with atomic(out / "report.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def report_header(cfg, rows: list[dict], mean_len: float, weights: str) -> list[str]:
    """report.md's title, the weights when they are not model.path's, and the sampling and kv settings."""
    lines = [f"# Evaluation: {cfg.model.path} on {cfg.env.id}", ""]
    if weights != cfg.model.path:
        lines += [f"Weights: {weights}.", ""]
    return lines + [
        f"{rows[0]['tasks']} tasks x {cfg.eval.samples} samples, temperature {cfg.sampling.temperature:g}, "
        f"top-p {cfg.sampling.top_p:g}, up to {cfg.sampling.max_new_tokens} new tokens, engine "
        f"{cfg.workers.engine}; full-cache mean sequence {mean_len:.1f} tokens; kv interval {cfg.kv.interval}, "
        f"window {cfg.kv.window}, sink {cfg.kv.sink}.",
        "",
    ]


def results_table(rows: list[dict], ks: list[int], metrics: list[str]) -> list[str]:
    """The markdown table of ``rows``, one per line and point, with pass@k for ``ks`` and the ``metrics``."""
    head = [
        "policy",
        "budget",
        "accuracy [95 % CI]",
        *[f"pass@{k}" for k in ks],
        *[k[5:] for k in metrics],
        "gen tokens",
        "truncated",
        *MODES,
        "KV retention",
        "peak KV",
        "tokens/s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        budget = r["point"] if r["budget_ratio"] is None else f"max({r['point']}, {r['budget_ratio']:g}·L)"
        lo, hi = wilson(r["accuracy"], r["tasks"])
        cells = [
            r["policy"],
            budget,
            f"{r['accuracy']:.3f} [{lo:.2f}, {hi:.2f}]",
            *[f"{r[f'pass@{k}']:.3f}" for k in ks],
            *[f"{r[k]:.3f}" for k in metrics],
            f"{r['gen_tokens']:.1f}",
            f"{r['truncated']:.0%}",
            *["n/a" if r[f"mode/{m}"] is None else f"{r[f'mode/{m}']:.0%}" for m in MODES],
            f"{r['kv_retention']:.0%}",
            f"{r['peak_kv_tokens']:.0f}",
            f"{r['decode_tokens_per_s']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def properties_section(rows: list[dict], props: dict) -> list[str]:
    """The task's properties (:mod:`kvrl.eval.properties`) and this run's orderings beside the papers'."""
    lines = [
        "",
        f"## The task's properties ({props['tasks']} reference traces, the model's own attention; "
        "kvrl/eval/properties.py)",
        "",
        "| property | value |",
        "|---|---|",
    ]
    lines += [f"| {text.format(**props)} | {props[key]:g} |" for key, text in PROPERTY_TEXT.items()]
    lines += ["", "## Orderings: this run beside the papers'", ""]
    lines += [f"- {paper} ({setting}): {claim}." for paper, setting, claim, _ in PAPERS]
    lines += ["", "This run (greedy accuracy, 95 % Wilson intervals decide agrees / reversed / tie):", ""]
    return lines + orderings(rows)


def column_notes(cfg, rows: list[dict], ks: list[int], metrics: list[str], notes: dict | None) -> list[str]:
    """The section "What the columns are": each column of the table, the environment's ``metrics`` by
    ``notes``."""
    loops = (
        f"the last {LOOP_WINDOW} words hold at most {LOOP_DISTINCT} distinct {LOOP_N}-grams"
        if loops_apply(cfg.sampling.max_new_tokens)
        else f"not applicable (n/a) here: outputs of at most {cfg.sampling.max_new_tokens} tokens cannot hold the "
        f"rule's {LOOP_WINDOW} words"
    )
    return [
        "## What the columns are",
        "",
        f"- accuracy: the share of samples with reward > 0 (pass@1), with its 95 % Wilson score interval over "
        f"the {rows[0]['tasks']} tasks (the accuracy picture's bars).",
        *(
            ["- pass@k: the unbiased estimate (Chen et al. 2021) that one of k samples of a task is right."]
            if ks
            else []
        ),
        *[
            f"- {k[5:]} (the environment's own metric, mean over samples): "
            f"{(notes or {}).get(k[5:], 'reported by its reward functions')}."
            for k in metrics
        ],
        "- gen tokens: generated tokens per sample (mean); truncated: the share cut at "
        f"sampling.max_new_tokens={cfg.sampling.max_new_tokens}.",
        f"- error modes (kvrl/eval/suite.py): correct = reward > 0; repetition = {loops}; no_answer = no "
        "\\boxed{} after the thinking block; wrong = otherwise.",
        "- KV retention: the share of the sequence so far still in the cache, averaged over decoding steps, "
        "layers and KV heads (100 % = the full cache).",
        "- peak KV: the most tokens a sequence held at once (mean over layers and KV heads), the accuracy "
        "picture's x axis.",
        "- tokens/s: decoding only, each line's untimed warm-up sequence left out.",
    ]


def evaluated_section(cfg, evaluated: dict) -> list[str]:
    """The section "What was evaluated": kvrl's version and commit, and the SHA-256 of the tasks, the model's
    files and each line's artefact."""
    folder, files = evaluated["model"]
    lines = [
        "",
        "## What was evaluated (SHA-256)",
        "",
        f"- kvrl {kvrl.__version__}, commit {evaluated['kvrl']}",
        f"- tasks: {evaluated['tasks']}",
        f"- model `{cfg.model.path}` from `{folder}`" + ("" if files else " (a hub id: files not hashed)"),
    ]
    lines += [f"  - `{name}` {sha}" for name, sha in files.items()]
    return lines + [
        f"- line `{name}`: `{path}` {sha or '(a folder)'}" for name, (path, sha) in evaluated["artefacts"].items()
    ]
