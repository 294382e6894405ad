"""job=eval: every policy x budget on one model, environment and engine, with the papers' metrics.

    python -m kvrl.run recipe=tiny_eval
    python -m kvrl.run recipe=tiny_eval eval.policies=[rkv,gkv] eval.budgets=[32,64]

Rows are ``eval.policies`` (zoo names, or names of ``eval.settings`` entries: a learned
ForesightKV scorer, RLKV heads, a zoo member with its own arguments; see
:class:`kvrl.eval.suite.PolicySpec`) at each of ``eval.budgets`` (<= 1: a fraction of the
full cache's mean sequence length; > 1: tokens), with ``kv.interval/window/sink``. In G-KV's
ratio mode (``kv.budget_ratio``, or a line's ``eval.settings.NAME.budget_ratio``) a budget is
the floor: an eviction keeps ``max(budget, ⌊ratio·tokens seen⌋)``. The full
cache always runs first: it is the reference line and the length fractions are of.
Each task is sampled ``eval.samples`` times (greedy when ``sampling.temperature=0``, else at
that temperature from the ``sampling.top_p`` nucleus).

Writes to ``output_dir``: ``samples.jsonl`` (one line per sample: policy, point, task, sample
index, completion, reward, info, error mode, KV usage — the checkpoint: a rerun skips every
sample already there, an interrupted one continues where it stopped), ``rows.jsonl`` (one
line per (policy, point), :func:`kvrl.eval.suite.summarise`), ``accuracy.png`` (accuracy
vs budget, full cache as a reference line), ``error_modes.png`` (stacked bars),
``retention.png`` (which key positions each KV head of one layer still holds at each
decoding step, for one sample) and ``report.md`` gathering them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig
from tqdm import tqdm

from kvrl.engines import make_engine
from kvrl.engines.hf import Sampling
from kvrl.envs import make
from kvrl.eval.suite import MODES, PolicySpec, error_mode, kv_usage, summarise
from kvrl.models.tiny import resolve_path
from kvrl.runlog import OutputLock, atomic, pyplot, setup_process


def read_samples(path: Path) -> list[dict]:
    """The samples written so far; a torn last line (a killed run) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def point_label(spec: PolicySpec, point) -> str:
    return "-" if point is None else f"s={point:g}" if spec.kind == "heads" else str(point)


def main(cfg) -> dict:
    # ---- the model, the environment, the tasks, what is already done
    setup_process(cfg.seed, threads=None)
    out = Path(cfg.output_dir)
    lock = OutputLock(out)
    ev = cfg.eval
    specs = [PolicySpec.of(name, ev.settings) for name in dict.fromkeys(["full", *ev.policies])]
    weights = resolve_path(cfg.model.path)  # a run directory: the folder of the weights it trained
    config = AutoConfig.from_pretrained(weights)
    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=cfg.seed)
    # a data set: its first rows, each once (a draw could cross an epoch and repeat one)
    data = getattr(env, "data", None)
    tasks = list(data)[:cfg.env.num_eval_tasks] if data else env.tasks(cfg.env.num_eval_tasks)
    samples_path = out / "samples.jsonl"
    done = read_samples(samples_path)
    with atomic(samples_path) as tmp:  # rewrite without a torn line, then append
        tmp.write_text("".join(json.dumps(s) + "\n" for s in done))
    have = {(s["policy"], s["point"], s["task"], s["sample"]) for s in done}
    engine = None
    kv = {"interval": cfg.kv.interval, "window": cfg.kv.window, "sink": cfg.kv.sink,
          "budget_ratio": cfg.kv.budget_ratio}
    traces = {}

    def run(spec: PolicySpec, point) -> list[dict]:
        """This row's samples: the ones on disk, and the missing ones generated and appended."""
        nonlocal engine
        label = point_label(spec, point)
        # batches and seeds are a fixed grid over (task, sample), so a rerun draws what an
        # uninterrupted run drew; a batch with every sample on disk is skipped
        grid = [(t, i) for t in tasks for i in range(ev.samples)]
        bs = cfg.sampling.batch_size
        batches = [lo for lo in range(0, len(grid), bs)
                   if any((spec.name, label, t.id, i) not in have for t, i in grid[lo:lo + bs])]
        if batches:
            engine = engine or make_engine(cfg)
            regime = spec.regime(config, point, kv)
            bar = tqdm(total=len(batches), desc=f"{spec.name} {label}", leave=False)
            with samples_path.open("a") as f:
                for lo in batches:
                    chunk = grid[lo:lo + bs]
                    sampling = Sampling(max_new_tokens=cfg.sampling.max_new_tokens,
                                        temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                                        seed=cfg.seed + lo)
                    o = engine.generate([t.prompt for t, _ in chunk], sampling, policy=regime)
                    seconds = o.timing["decode"] / len(chunk)
                    for b, (task, i) in enumerate(chunk):
                        if (spec.name, label, task.id, i) in have:  # written before an interruption
                            continue
                        reward, info = env.score(task, o.texts[b])
                        retention, peak = (1.0, float(len(o.prompt_ids[b]) + len(o.tokens[b]))) if o.traces is None \
                            else kv_usage(o.trace(b), len(o.prompt_ids[b]))
                        if o.traces is not None and (spec.name, label) not in traces:
                            traces[spec.name, label] = (o.trace(b), len(o.prompt_ids[b]))
                        s = {"policy": spec.name, "point": label, "task": task.id, "sample": i,
                             "completion": o.texts[b], "reward": reward, "info": info, "tokens": len(o.tokens[b]),
                             "prompt_tokens": len(o.prompt_ids[b]), "finish": o.finish_reasons[b],
                             "mode": error_mode(o.texts[b], reward), "retention": retention, "peak_kv": peak,
                             "seconds": seconds}
                        f.write(json.dumps(s) + "\n")
                        done.append(s)
                        have.add((spec.name, label, task.id, i))
                    f.flush()
                    bar.update()
            bar.close()
        return [s for s in done if s["policy"] == spec.name and s["point"] == label]

    # ---- the full cache first: the reference, and what budget fractions are of
    full = run(specs[0], None)
    mean_len = sum(s["prompt_tokens"] + s["tokens"] for s in full) / len(full)
    budgets = sorted({round(b * mean_len) if b <= 1 else int(b) for b in ev.budgets})
    if budgets and budgets[0] <= cfg.kv.sink + cfg.kv.window:
        raise ValueError(f"eval.budgets gives {budgets[0]} tokens, not more than kv.sink + kv.window = "
                         f"{cfg.kv.sink + cfg.kv.window}; raise the budget or lower kv.sink / kv.window")

    # ---- every policy at every point, one progress line each
    rows = []
    for spec in specs:
        for point in spec.points(budgets):
            row = {"policy": spec.name, "kind": spec.kind, "point": point_label(spec, point),
                   "budget": point if spec.budgeted else None, "budget_ratio": spec.budget_ratio(kv),
                   **summarise(run(spec, point), ev.pass_k)}
            rows.append(row)
            print(f"{row['policy']:<12}{row['point']:>8}  acc {row['accuracy']:.3f} ± {row['accuracy_se']:.3f}  "
                  f"len {row['gen_tokens']:.1f}  kv {row['kv_retention']:.0%}  {row['decode_tokens_per_s']:.0f} tok/s")
    with atomic(out / "rows.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # ---- pictures and report.md
    plot_accuracy(rows, out / "accuracy.png", f"{cfg.model.path} on {cfg.env.id}")
    plot_modes(rows, out / "error_modes.png")
    shown = next(iter(traces.items()), None)
    if shown is not None:
        plot_retention(*shown[1], out / "retention.png", f"{shown[0][0]} at {shown[0][1]}")
    write_report(cfg, rows, mean_len, out, weights, retention=shown is not None)
    lock.release()
    return {"rows": rows, "mean_seq_len": mean_len}


def plot_accuracy(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["policy"] for r in rows):
        line = [r for r in rows if r["policy"] == name]
        if line[0]["kind"] == "full":
            ax.axhline(line[0]["accuracy"], color="k", ls="--", label="full cache")
        else:  # budgets on x; RLKV heads at their mean cached tokens
            x = [r["budget"] if r["budget"] is not None else r["peak_kv_tokens"] for r in line]
            ax.errorbar(x, [r["accuracy"] for r in line], yerr=[r["accuracy_se"] for r in line], marker="o",
                        capsize=2, label=name)
    ax.set(xlabel="KV budget (tokens per head)", ylabel="accuracy (pass@1)", title=title)
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
        ax.bar(labels, share, bottom=bottom, label=mode)
        bottom = [b + s for b, s in zip(bottom, share)]
    ax.set(ylabel="share of samples", title="error modes")
    ax.tick_params(axis="x", rotation=90, labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_retention(trace, prompt_len: int, path: Path, title: str, layer: int = 0) -> None:
    """For one sample and one layer: per KV head, key position (x) held at each step (y)."""
    plt = pyplot()
    death = trace.full()[layer, 0].long()  # [H, T]
    T = int(trace.lengths[0])
    q = torch.arange(prompt_len, T)[:, None]
    k = torch.arange(T)[None]
    heads = death.shape[0]
    fig, axes = plt.subplots(1, heads, figsize=(3 * heads, 3), squeeze=False)
    for h in range(heads):
        held = (k <= q) & (q < death[h, :T][None])
        axes[0, h].imshow(held.numpy(), aspect="auto", cmap="Greys", interpolation="nearest",
                          extent=(0, T, T, prompt_len))
        axes[0, h].set(title=f"layer {layer}, KV head {h}", xlabel="key position", ylabel="decoding step (position)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(cfg, rows: list[dict], mean_len: float, out: Path, weights: str, retention: bool) -> None:
    ks = [k for k in cfg.eval.pass_k if f"pass@{k}" in rows[0]]
    head = ["policy", "budget", "accuracy", *[f"pass@{k}" for k in ks], "gen tokens", "truncated",
            *MODES, "KV retention", "peak KV", "tokens/s"]
    lines = [f"# Evaluation: {cfg.model.path} on {cfg.env.id}", ""]
    if weights != cfg.model.path:
        lines += [f"Weights: {weights}.", ""]
    lines += [f"{rows[0]['tasks']} tasks x {cfg.eval.samples} samples, temperature {cfg.sampling.temperature:g}, "
              f"top-p {cfg.sampling.top_p:g}, up to {cfg.sampling.max_new_tokens} new tokens, engine "
              f"{cfg.workers.engine}; full-cache mean sequence {mean_len:.1f} tokens; kv interval {cfg.kv.interval}, "
              f"window {cfg.kv.window}, sink {cfg.kv.sink}.", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        budget = r["point"] if r["budget_ratio"] is None else f"max({r['point']}, {r['budget_ratio']:g}·L)"
        cells = [r["policy"], budget, f"{r['accuracy']:.3f} ± {r['accuracy_se']:.3f}",
                 *[f"{r[f'pass@{k}']:.3f}" for k in ks], f"{r['gen_tokens']:.1f}", f"{r['truncated']:.0%}",
                 *[f"{r[f'mode/{m}']:.0%}" for m in MODES], f"{r['kv_retention']:.0%}", f"{r['peak_kv_tokens']:.0f}",
                 f"{r['decode_tokens_per_s']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "![accuracy vs budget](accuracy.png)", "", "![error modes](error_modes.png)", ""]
    if retention:
        lines += ["![retention](retention.png)", ""]
    lines += ["Error modes (kvrl/eval/suite.py): correct = reward > 0; repetition = the last 120 words hold at "
              "most 12 distinct 4-grams; no_answer = no \\boxed{} after the thinking block; wrong = otherwise."]
    with atomic(out / "report.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
