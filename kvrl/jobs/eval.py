"""job=eval: every policy x budget on one model, environment and engine, with the papers' metrics.

    python -m kvrl.run recipe=tiny_eval
    python -m kvrl.run recipe=tiny_eval eval.policies=[rkv,gkv] eval.budgets=[32,64]

Rows are ``eval.policies`` (zoo names, or names of ``eval.settings`` entries: a learned
ForesightKV scorer, RLKV heads, a zoo member with its own arguments; see
:class:`kvrl.eval.suite.PolicySpec`) at each of ``eval.budgets`` (<= 1: a fraction of the
full cache's mean sequence length; > 1: tokens), with ``kv.interval/window/sink`` (a token
policy's line may set its own: ``eval.settings.rkv.window=8``). In G-KV's
ratio mode (``kv.budget_ratio``, or a line's ``eval.settings.NAME.budget_ratio``) a budget is
the floor: an eviction keeps ``max(budget, ⌊ratio·tokens seen⌋)``. The full
cache always runs first: it is the reference line and the length fractions are of.
Each task is sampled ``eval.samples`` times (greedy when ``sampling.temperature=0``, else at
that temperature from the ``sampling.top_p`` nucleus).

Writes to ``output_dir``: ``samples.jsonl`` (one line per sample: policy, point, task, sample
index, completion, reward, info, error mode, KV usage — the checkpoint: a rerun skips every
sample already there, an interrupted one continues where it stopped), ``settings.json``
(what the samples depend on, by digest: see below), ``rows.jsonl`` (one
line per (policy, point), :func:`kvrl.eval.suite.summarise`), ``accuracy.png`` (accuracy with
its 95 % Wilson interval against the measured peak KV tokens per sequence, each point labelled
with its nominal budget, full cache as a reference line), ``error_modes.png`` (stacked bars; repetition marked not
applicable where outputs are shorter than its rule's window), ``retention.png`` (for one sample
of every line: which key positions each KV head of layer 0 still holds at each decoding step)
and ``report.md`` gathering them, with what each column is, the evaluated model files, scorers,
gates and policies of the user's own by checksum, and the kvrl commit. Decode tokens/s leave out each line's first call, an untimed warm-up sequence (a
first call pays one-time costs: native builds, first dispatches).

A sample depends on more than (policy, point, task, sample index): every sample line records
``setting``, a digest of the run's settings (the model's files by content checksum, dtype,
device, engine, seed, sampling, environment, ``kv.*``) and of its line's (the policy, its
arguments, the checksum of the scorer or gates it loads), and ``task_sha``, a digest of the
task's content. A rerun into a folder whose samples of a line it runs have another setting, or
of a task whose content changed, is refused with the keys that differ (``settings.json`` keeps
each digest's settings), as a resumed training run is; other lines' samples stay where they
are. The model's files are hashed once per folder: a rerun whose file sizes and modification
times match ``settings.json``'s reuses the checksums. Task ids must be unique. A value read from the
environment (``env.system_prompt='${oc.env:NAME}'``, a token in ``env.kwargs``) keys the samples by its
value but is written to ``settings.json``, and shown in a refusal, as its reference.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer
from tqdm import tqdm

import kvrl
from kvrl.engines import make_engine
from kvrl.engines.base import Sampling, check_prompts
from kvrl.envs import make
from kvrl.envs.chat import Chat
from kvrl.eval.suite import (
    LOOP_DISTINCT,
    LOOP_N,
    LOOP_WINDOW,
    MODES,
    PolicySpec,
    error_mode,
    kv_usage,
    loops_apply,
    summarise,
    wilson,
)
from kvrl.models.tiny import resolve_path
from kvrl.runlog import OutputLock, atomic, config_changes, disk_full_names, pyplot, setup_process, sha256_of
from kvrl.section import ConfigError


def read_samples(path: Path) -> list[dict]:
    """The samples written so far; a torn last line (a killed run) is dropped. A sample written twice (a
    line copied, two files joined) is refused naming both lines: a row would count it twice."""
    if not path.exists():
        return []
    rows, seen = [], {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        key = tuple(row.get(k) for k in ("policy", "point", "task", "sample"))
        if key in seen:
            raise ConfigError(
                f"{path}:{number} holds the sample of {path}:{seen[key]} again (policy {key[0]}, point "
                f"{key[1]}, task {key[2]!r}, sample {key[3]}): the file was edited or joined with "
                f"another; delete line {number} (or the file, to generate its samples afresh)"
            )
        seen[key] = number
        rows.append(row)
    return rows


def digest(obj) -> str:
    """A short digest of a JSON-able value (keys sorted): what samples.jsonl keys settings and tasks by."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def task_sha(task) -> str:
    """The task's content: what it asks and what its rewards read (not where its row sits in a file)."""
    meta = {k: v for k, v in task.meta.items() if k != "source"}
    return digest([task.id, task.prompt, task.answer, meta])


def model_files(folder: Path, known: dict) -> dict[str, str]:
    """{file: SHA-256} of every file in the model folder. ``known`` ({path: [size, mtime_ns, sha]},
    updated here) spares rereading gigabytes for a file whose size and modification time it has."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        stat = path.stat()
        seen = known.get(str(path.resolve()))
        if seen is None or seen[:2] != [stat.st_size, stat.st_mtime_ns]:
            seen = known[str(path.resolve())] = [stat.st_size, stat.st_mtime_ns, sha256_of(path)]
        files[str(path.relative_to(folder))] = seen[2]
    return files


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
    try:  # a row the model cannot take (a broken row, a prompt longer than it holds), by file:line, as RL's
        env = make(cfg.env.id, **cfg.env.kwargs)
        env.reset(seed=cfg.seed)
        # a data set: its first rows, each once (a draw could cross an epoch and repeat one)
        data = getattr(env, "data", None)
        tasks = list(data[: cfg.env.num_eval_tasks]) if data else env.tasks(cfg.env.num_eval_tasks)
        check_prompts(
            tasks,
            AutoTokenizer.from_pretrained(weights),
            cfg.model.max_model_len or getattr(config, "max_position_embeddings", None),
            Chat.of(cfg.env),
        )
    except ValueError as err:  # the user's data, not a bug of ours
        raise ConfigError(str(err)) from None
    ids = Counter(t.id for t in tasks)
    if any(n > 1 for n in ids.values()):  # samples are keyed by task id, and a row counts tasks by id
        where = {}
        for k, t in enumerate(tasks):
            where.setdefault(t.id, []).append(t.meta.get("source", f"task {k + 1}"))
        shared = [
            f"{i!r} by {', '.join(map(str, where[i][:5]))}{' ...' if n > 5 else ''} ({n} tasks)"
            for i, n in ids.items()
            if n > 1
        ]
        raise ConfigError(
            f"{cfg.env.id}: task ids must be unique, but {len(shared)} are shared: "
            + "; ".join(shared[:5])
            + ("; ..." if len(shared) > 5 else "")
            + "; give every task its own id (a data set's id field) or drop the repeated rows"
        )
    # ---- what the samples depend on (module docstring): another setting's samples are refused
    settings_path = out / "settings.json"
    recorded = json.loads(settings_path.read_text()) if settings_path.exists() else {"settings": {}, "files": {}}
    local = Path(weights).is_dir()
    files = model_files(Path(weights), recorded["files"]) if local else {}  # {file: SHA-256}
    run_settings = {
        "model.path": None if local else cfg.model.path,  # a local folder counts by its content
        **{f"model.files.{name}": sha for name, sha in files.items()},
        "model.dtype": cfg.model.dtype,
        "model.stop_ids": cfg.model.stop_ids,
        "model.max_model_len": cfg.model.max_model_len,
        "device": cfg.device,
        "workers.engine": cfg.workers.engine,
        "seed": cfg.seed,
        "sampling.max_new_tokens": cfg.sampling.max_new_tokens,
        "sampling.temperature": cfg.sampling.temperature,
        "sampling.top_p": cfg.sampling.top_p,
        "sampling.batch_size": cfg.sampling.batch_size,  # batches draw their seeds by offset
        "env.id": cfg.env.id,
        "env.kwargs": cfg.env.kwargs,
        "env.chat_template": cfg.env.chat_template,
        "env.system_prompt": cfg.env.system_prompt,
        "env.thinking": cfg.env.thinking,
        "kv.interval": cfg.kv.interval,
        "kv.window": cfg.kv.window,
        "kv.sink": cfg.kv.sink,
        "kv.budget_ratio": cfg.kv.budget_ratio,
    }
    # a value read from the environment (a token, a system prompt) keys the samples but is written down, and
    # shown, as its reference `${oc.env:NAME}` (kvrl.config): settings.json never holds a secret
    hidden = {key: cfg.env_references[key] for key in run_settings if key in cfg.env_references}
    setting, settings, artefacts = {}, {}, {}
    kv = {
        "interval": cfg.kv.interval,
        "window": cfg.kv.window,
        "sink": cfg.kv.sink,
        "budget_ratio": cfg.kv.budget_ratio,
    }
    for spec in specs:
        try:  # a scorer or gates that cannot load (damaged, another model's, not finite): refused before any sample
            artefact = spec.artefact()
            if artefact is not None:
                own = {**kv, **spec.kwargs}
                spec.regime(config, spec.points([own["sink"] + own["window"] + 1])[0], kv)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(f"eval.settings.{spec.name}: {err}") from None
        line = {
            "policy": spec.kind,
            **{k: v for k, v in spec.kwargs.items() if k != "sparsities"},  # only points
            "artefact_sha256": sha256_of(artefact) if artefact is not None and artefact.is_file() else None,
        }
        if artefact is not None:
            artefacts[spec.name] = (artefact, line["artefact_sha256"])
        settings[spec.name] = {**run_settings, **{f"eval.settings.{spec.name}.{k}": v for k, v in line.items()}}
        setting[spec.name] = digest(settings[spec.name])
    samples_path = out / "samples.jsonl"
    done = read_samples(samples_path)
    other = next((s for s in done if s["policy"] in setting and s.get("setting") != setting[s["policy"]]), None)
    if other is not None:
        before = recorded["settings"].get(other.get("setting"))
        changed = (
            config_changes(before, {**settings[other["policy"]], **hidden}, ())
            if before
            else [
                f"(not recorded in {settings_path}: written by a kvrl that kept no settings, or the file was removed)"
            ]
        )
        changed = changed or [
            f"{', '.join(hidden)}: read from the environment, which gives another value than then"
        ]  # the references are equal: a variable's value differs
        raise ConfigError(
            f"{out} holds samples of line {other['policy']} from another setting than this "
            "evaluation's:\n  " + "\n  ".join(changed) + "\nrerun with those settings to reuse them, "
            "or give this evaluation its own output_dir=..."
        )
    shas = {t.id: task_sha(t) for t in tasks}
    moved = sorted(
        {s["task"] for s in done if s["policy"] in setting and shas.get(s["task"], s["task_sha"]) != s["task_sha"]}
    )
    if moved:
        raise ConfigError(
            f"{out} holds samples of {len(moved)} task(s) whose content has changed since "
            f"({', '.join(moved[:5])}{' ...' if len(moved) > 5 else ''}): the data or the environment "
            "changed; give this evaluation its own output_dir=..."
        )
    recorded["settings"].update({setting[name]: {**value, **hidden} for name, value in settings.items()})
    with atomic(settings_path) as tmp:
        tmp.write_text(json.dumps(recorded, indent=1, sort_keys=True))
    with atomic(samples_path) as tmp:  # rewrite without a torn line, then append
        tmp.write_text("".join(json.dumps(s) + "\n" for s in done))
    have = {(s["policy"], s["point"], s["task"], s["sample"]) for s in done}
    engine = None
    traces, warm = {}, set()
    cells = {(t.id, i) for t in tasks for i in range(ev.samples)}

    def run(spec: PolicySpec, point) -> list[dict]:
        """This row's samples: the ones on disk, and the missing ones generated and appended."""
        nonlocal engine
        label = point_label(spec, point)
        # batches and seeds are a fixed grid over (task, sample), so a rerun draws what an
        # uninterrupted run drew; a batch with every sample on disk is skipped
        grid = [(t, i) for t in tasks for i in range(ev.samples)]
        bs = cfg.sampling.batch_size
        batches = [
            lo
            for lo in range(0, len(grid), bs)
            if any((spec.name, label, t.id, i) not in have for t, i in grid[lo : lo + bs])
        ]
        if batches:
            engine = engine or make_engine(cfg)
            regime = spec.regime(config, point, kv)
            if spec.name not in warm:  # untimed: a line's first call pays one-time costs (native builds)
                engine.generate(
                    [grid[batches[0]][0].prompt], Sampling(cfg.sampling.max_new_tokens, seed=cfg.seed), policy=regime
                )
                warm.add(spec.name)
            bar = tqdm(total=len(batches), desc=f"{spec.name} {label}", leave=False)
            with disk_full_names(samples_path), samples_path.open("a") as f:
                for lo in batches:
                    chunk = grid[lo : lo + bs]
                    sampling = Sampling(
                        max_new_tokens=cfg.sampling.max_new_tokens,
                        temperature=cfg.sampling.temperature,
                        top_p=cfg.sampling.top_p,
                        seed=cfg.seed + lo,
                    )
                    o = engine.generate([t.prompt for t, _ in chunk], sampling, policy=regime)
                    seconds = o.timing["decode"] / len(chunk)
                    for b, (task, i) in enumerate(chunk):
                        if (spec.name, label, task.id, i) in have:  # written before an interruption
                            continue
                        reward, info = env.score(task, o.texts[b])
                        retention, peak = (
                            (1.0, float(len(o.prompt_ids[b]) + len(o.tokens[b])))
                            if o.traces is None
                            else kv_usage(o.trace(b), len(o.prompt_ids[b]))
                        )
                        if o.traces is not None and (spec.name, label) not in traces:
                            traces[spec.name, label] = (o.trace(b), len(o.prompt_ids[b]))
                        s = {
                            "policy": spec.name,
                            "point": label,
                            "setting": setting[spec.name],
                            "task": task.id,
                            "task_sha": shas[task.id],
                            "sample": i,
                            "completion": o.texts[b],
                            "reward": reward,
                            "info": info,
                            "tokens": len(o.tokens[b]),
                            "prompt_tokens": len(o.prompt_ids[b]),
                            "finish": o.finish_reasons[b],
                            "mode": error_mode(o.texts[b], reward),
                            "retention": retention,
                            "peak_kv": peak,
                            "seconds": seconds,
                        }
                        f.write(json.dumps(s) + "\n")
                        done.append(s)
                        have.add((spec.name, label, task.id, i))
                    f.flush()
                    bar.update()
            bar.close()
        return [
            s for s in done if s["policy"] == spec.name and s["point"] == label and (s["task"], s["sample"]) in cells
        ]  # this run's tasks and samples, not a larger earlier run's

    # ---- the full cache first: the reference, and what budget fractions are of
    full = run(specs[0], None)
    mean_len = sum(s["prompt_tokens"] + s["tokens"] for s in full) / len(full)
    budgets = sorted({round(b * mean_len) if b <= 1 else int(b) for b in ev.budgets})
    if budgets and budgets[0] <= cfg.kv.sink + cfg.kv.window:
        raise ConfigError(
            f"eval.budgets gives {budgets[0]} tokens, not more than kv.sink + kv.window = "
            f"{cfg.kv.sink + cfg.kv.window}; raise the budget or lower kv.sink / kv.window"
        )

    # ---- every policy at every point, one progress line each (report.md's glossary says what they are)
    rows = []
    for spec in specs:
        for point in spec.points(budgets):
            row = {
                "policy": spec.name,
                "kind": spec.kind,
                "point": point_label(spec, point),
                "budget": point if spec.budgeted else None,
                "budget_ratio": spec.budget_ratio(kv),
                **summarise(run(spec, point), ev.pass_k),
            }
            if not loops_apply(cfg.sampling.max_new_tokens):
                row["mode/repetition"] = None  # no output can hold the rule's window: not 0 %, not applicable
            if not rows:
                print(console_line(row, header=True))
            rows.append(row)
            print(console_line(row))
    with atomic(out / "rows.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # ---- the task's properties, measured on the model's own attention over reference traces
    props = None
    if ev.properties:
        from kvrl.eval.properties import measure
        from kvrl.models.tiny import load_model

        model, tok = load_model(cfg.model.path, device=cfg.device)
        props = measure(model, tok, tasks[:64])
        with atomic(out / "properties.json") as tmp:
            tmp.write_text(json.dumps(props, indent=1) + "\n")

    # ---- pictures and report.md
    with disk_full_names(out / "accuracy.png"):  # a full disk names the file, as every atomic write does
        plot_accuracy(rows, out / "accuracy.png", f"{cfg.model.path} on {cfg.env.id}")
    with disk_full_names(out / "error_modes.png"):
        plot_modes(rows, out / "error_modes.png")
    shown = retention_samples(traces, rows)
    if shown:
        with disk_full_names(out / "retention.png"):
            plot_retention(shown, out / "retention.png")
    evaluated = {"model": (weights, files), "artefacts": artefacts, "kvrl": kvrl_commit()}
    # what the environment's own metrics are: the first sentence of each reward function's docstring
    notes = {
        r.name: " ".join((r.fn.__doc__ or "").replace("``", "`").split()).split(". ")[0].rstrip(".")
        or "its reward function has no docstring"
        for r in getattr(env, "rewards", [])
    }
    write_report(
        cfg, rows, mean_len, out, weights, retention=bool(shown), props=props, evaluated=evaluated, notes=notes
    )
    lock.release()
    return {"rows": rows, "mean_seq_len": mean_len}


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


def kvrl_commit() -> str:
    """The git commit of the kvrl that runs (``+ uncommitted changes`` when its checkout has any), or
    ``unknown`` when kvrl is not a git checkout (an installed wheel; a repository kvrl merely sits in,
    such as a project's venv, is not kvrl's)."""
    import subprocess

    here = Path(kvrl.__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(here), *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() / "kvrl" != here:
            return "unknown (kvrl is not a git checkout of its own)"
        commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git, or not a repository
        return "unknown (kvrl is not a git checkout)"
    return commit + (" + uncommitted changes" if dirty else "")


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
    ks = [k for k in cfg.eval.pass_k if f"pass@{k}" in rows[0]]
    metrics = [k for k in rows[0] if k.startswith("info/")]
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
    lines = [f"# Evaluation: {cfg.model.path} on {cfg.env.id}", ""]
    if weights != cfg.model.path:
        lines += [f"Weights: {weights}.", ""]
    lines += [
        f"{rows[0]['tasks']} tasks x {cfg.eval.samples} samples, temperature {cfg.sampling.temperature:g}, "
        f"top-p {cfg.sampling.top_p:g}, up to {cfg.sampling.max_new_tokens} new tokens, engine "
        f"{cfg.workers.engine}; full-cache mean sequence {mean_len:.1f} tokens; kv interval {cfg.kv.interval}, "
        f"window {cfg.kv.window}, sink {cfg.kv.sink}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
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
    if props is not None:
        lines += [
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
        lines += orderings(rows)
    lines += ["", "![accuracy vs budget](accuracy.png)", "", "![error modes](error_modes.png)", ""]
    if retention:
        lines += ["![retention](retention.png)", ""]
    loops = (
        f"the last {LOOP_WINDOW} words hold at most {LOOP_DISTINCT} distinct {LOOP_N}-grams"
        if loops_apply(cfg.sampling.max_new_tokens)
        else f"not applicable (n/a) here: outputs of at most {cfg.sampling.max_new_tokens} tokens cannot hold the "
        f"rule's {LOOP_WINDOW} words"
    )
    lines += [
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
    if evaluated is not None:
        folder, files = evaluated["model"]
        lines += [
            "",
            "## What was evaluated (SHA-256)",
            "",
            f"- kvrl {kvrl.__version__}, commit {evaluated['kvrl']}",
            f"- model `{cfg.model.path}` from `{folder}`" + ("" if files else " (a hub id: files not hashed)"),
        ]
        lines += [f"  - `{name}` {sha}" for name, sha in files.items()]
        lines += [
            f"- line `{name}`: `{path}` {sha or '(a folder)'}" for name, (path, sha) in evaluated["artefacts"].items()
        ]
    with atomic(out / "report.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
