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
The tasks are the first ``env.num_eval_tasks`` of the environment's stream at ``seed`` + 9001
(:func:`task_seed`; a data set's first rows), which no run at ``seed`` trains on; a model whose run
trained on them is warned about (:func:`stream_warning`). Each task is sampled ``eval.samples``
times (greedy when ``sampling.temperature=0``, else at that temperature from the ``sampling.top_p``
nucleus).

Writes to ``output_dir`` (each file described in ``docs/evaluation.md``): ``samples.jsonl`` (one line
per sample; the checkpoint: a rerun skips every sample already there, an interrupted one continues
where it stopped), ``settings.json`` (what the samples depend on, by digest: see below),
``rows.jsonl`` (one line per (policy, point), :func:`kvrl.eval.suite.summarise`), ``accuracy.png``
(with 95 % Wilson intervals, against the measured peak KV tokens per sequence), ``error_modes.png``,
``retention.png`` and ``report.md`` gathering them, with the evaluated model files, scorers, gates
and policies of the user's own by checksum and the kvrl commit. Decode tokens/s leave out each
line's first call, an untimed warm-up sequence (it pays one-time costs: native builds).

A sample depends on more than (policy, point, task, sample index): every sample line records
``setting``, a digest of the run's settings (the model's files by content checksum, dtype,
device, engine, seed, task stream, sampling, environment, ``kv.*``) and of its line's (the policy, its
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
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from kvrl.bench import TEST_SEED
from kvrl.engines import make_engine
from kvrl.engines.base import Sampling, check_prompts
from kvrl.envs import make
from kvrl.envs.chat import Chat
from kvrl.eval.report import console_line, report
from kvrl.eval.suite import (
    PolicySpec,
    error_mode,
    kv_usage,
    loops_apply,
    summarise,
)
from kvrl.models.tiny import resolve_path
from kvrl.runlog import OutputLock, atomic, config_changes, disk_full_names, kvrl_commit, setup_process, sha256_of
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


def task_seed(cfg) -> int:
    """The seed of the task stream job=eval judges: ``seed`` + kvrl.bench's TEST_SEED. A run at ``seed`` trains
    on ``seed``'s stream (kvrl.workers.controller), so at the same seed the two never share a task; at seed 0
    it is the test stream the benchmarks judge on."""
    return cfg.seed + TEST_SEED


def draw_tasks(cfg) -> tuple:
    """The environment and the tasks job=eval judges: the first ``env.num_eval_tasks`` of its stream at
    :func:`task_seed`, or of a data set its first rows, each once (a draw could cross an epoch and repeat one)."""
    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=task_seed(cfg))
    data = getattr(env, "data", None)
    return env, list(data[: cfg.env.num_eval_tasks]) if data else env.tasks(cfg.env.num_eval_tasks)


def trained_on(weights: Path) -> dict | None:
    """The settings of the kvrl run that trained the model folder ``weights`` (its final ``model/`` or a
    checkpoint's), as its newest checkpoint's config.json holds them; None for a model no kvrl run trained."""
    own = weights.parent / "config.json"  # weights is RUN/checkpoints/step_N/model
    saved = [own] if own.is_file() else sorted(weights.parent.glob("checkpoints/step_*/config.json"))
    settings = json.loads(saved[-1].read_text()) if saved else {}
    return settings if "job" in settings and "env.id" in settings else None


def stream_warning(cfg, weights: Path, data: bool) -> str | None:
    """What to tell a user whose model a kvrl run trained on the tasks this evaluation judges (its accuracy
    there is not held out), else None: the run's environment is this one's and, for a procedural one, its
    seed is :func:`task_seed` (its stream is this evaluation's), or, for a data set (``data``: whose first rows
    are judged whatever the seed), its arguments are this one's."""
    run = trained_on(weights)
    if run is None or run["env.id"] != cfg.env.id:
        return None
    if data:
        if run.get("env.kwargs") != cfg.env.kwargs:
            return None
        return (
            f"the model {weights} was trained (job={run['job']}) on {cfg.env.id} with these env.kwargs, whose "
            f"first {cfg.env.num_eval_tasks} rows this evaluation judges: its accuracy is not on held-out tasks; "
            "judge it on another data set (env.kwargs)"
        )
    if run.get("seed") != task_seed(cfg):
        return None
    return (
        f"the model {weights} was trained (job={run['job']}) on {cfg.env.id}'s task stream at seed {run['seed']}, "
        f"the stream this evaluation judges (seed={cfg.seed} + {TEST_SEED}): its accuracy is not on held-out "
        f"tasks; set seed=<another value than {cfg.seed}>"
    )


def which_tasks(cfg, data: bool) -> str:
    """The tasks judged, as report.md and the console name them."""
    if data:
        return f"the first {cfg.env.num_eval_tasks} rows of {cfg.env.id}'s data set"
    return (
        f"the first {cfg.env.num_eval_tasks} tasks of {cfg.env.id}'s stream at seed {task_seed(cfg)} (seed={cfg.seed} "
        f"+ {TEST_SEED}; a run at seed={cfg.seed} trains on seed {cfg.seed}'s)"
    )


def load_tasks(cfg, weights: str, config) -> tuple:
    """:func:`draw_tasks`, refused as a ConfigError when a row is one the model cannot take (by file:line) or two
    tasks share an id."""
    try:  # a row the model cannot take (a broken row, a prompt longer than it holds), by file:line, as RL's
        env, tasks = draw_tasks(cfg)
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
    return env, tasks


def line_settings(cfg, specs: list[PolicySpec], config, weights: str, known: dict, kv: dict) -> tuple:
    """What each line's samples depend on (the module docstring): ``({line: {key: value}}, the keys read from
    the environment with their references, {line: (scorer or gates file, SHA-256)}, {model file: SHA-256})``.
    A line's scorer or gates are loaded here once, so that one that cannot load is refused before any sample;
    ``known`` is settings.json's file checksums, updated."""
    local = Path(weights).is_dir()
    files = model_files(Path(weights), known) if local else {}  # {file: SHA-256}
    run_settings = {
        "model.path": None if local else cfg.model.path,  # a local folder counts by its content
        **{f"model.files.{name}": sha for name, sha in files.items()},
        "model.dtype": cfg.model.dtype,
        "model.stop_ids": cfg.model.stop_ids,
        "model.max_model_len": cfg.model.max_model_len,
        "device": cfg.device,
        "workers.engine": cfg.workers.engine,
        "seed": cfg.seed,
        "tasks.seed": task_seed(cfg),  # the stream the tasks are drawn from (a data set: its first rows)
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
    settings, artefacts = {}, {}
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
    return settings, hidden, artefacts, files


@dataclass
class Samples:
    """The samples of every line: those in ``path`` (samples.jsonl), and the missing ones generated and appended,
    a line at a time (:meth:`line`). Batches and seeds are a fixed grid over (task, sample), so a rerun draws
    what an uninterrupted run drew, and a batch with every sample on disk is skipped. The engine starts at
    the first sample to generate; ``traces`` keeps one sample's eviction trace per line and point, for
    retention.png."""

    cfg: Any
    env: Any
    tasks: list
    config: Any  # the model's transformers config
    kv: dict  # kv.interval / window / sink / budget_ratio, which a line's own settings replace
    setting: dict  # line -> the digest of its settings
    shas: dict  # task id -> task_sha
    path: Path
    done: list[dict]  # the samples read from path, and those appended since
    engine: Any = field(default=None, init=False)
    traces: dict = field(default_factory=dict, init=False)
    warm: set = field(default_factory=set, init=False)  # the lines whose untimed warm-up ran

    def __post_init__(self):
        self.have = {(s["policy"], s["point"], s["task"], s["sample"]) for s in self.done}
        # batches and seeds are a fixed grid over (task, sample), so a rerun draws what an
        # uninterrupted run drew; a batch with every sample on disk is skipped
        self.grid = [(t, i) for t in self.tasks for i in range(self.cfg.eval.samples)]
        self.cells = {(t.id, i) for t, i in self.grid}

    def line(self, spec: PolicySpec, point) -> list[dict]:
        """This line's samples at ``point``, of this run's tasks and samples (not a larger earlier run's)."""
        label = point_label(spec, point)
        grid = self.grid
        bs = self.cfg.sampling.batch_size
        batches = [
            lo
            for lo in range(0, len(grid), bs)
            if any((spec.name, label, t.id, i) not in self.have for t, i in grid[lo : lo + bs])
        ]
        if batches:
            self.engine = self.engine or make_engine(self.cfg)
            regime = spec.regime(self.config, point, self.kv)
            if spec.name not in self.warm:  # untimed: a line's first call pays one-time costs (native builds)
                self.engine.generate(
                    [grid[batches[0]][0].prompt],
                    Sampling(self.cfg.sampling.max_new_tokens, seed=self.cfg.seed),
                    policy=regime,
                )
                self.warm.add(spec.name)
            bar = tqdm(total=len(batches), desc=f"{spec.name} {label}", leave=False)
            with disk_full_names(self.path), self.path.open("a") as f:
                for lo in batches:
                    chunk = grid[lo : lo + bs]
                    sampling = Sampling(
                        max_new_tokens=self.cfg.sampling.max_new_tokens,
                        temperature=self.cfg.sampling.temperature,
                        top_p=self.cfg.sampling.top_p,
                        seed=self.cfg.seed + lo,
                    )
                    o = self.engine.generate([t.prompt for t, _ in chunk], sampling, policy=regime)
                    seconds = o.timing["decode"] / len(chunk)
                    for b, (task, i) in enumerate(chunk):
                        if (spec.name, label, task.id, i) in self.have:  # written before an interruption
                            continue
                        reward, info = self.env.score(task, o.texts[b])
                        retention, peak = (
                            (1.0, float(len(o.prompt_ids[b]) + len(o.tokens[b])))
                            if o.traces is None
                            else kv_usage(o.trace(b), len(o.prompt_ids[b]))
                        )
                        if o.traces is not None and (spec.name, label) not in self.traces:
                            self.traces[spec.name, label] = (o.trace(b), len(o.prompt_ids[b]))
                        s = {
                            "policy": spec.name,
                            "point": label,
                            "setting": self.setting[spec.name],
                            "task": task.id,
                            "task_sha": self.shas[task.id],
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
                        self.done.append(s)
                        self.have.add((spec.name, label, task.id, i))
                    f.flush()
                    bar.update()
            bar.close()
        return [
            s
            for s in self.done
            if s["policy"] == spec.name and s["point"] == label and (s["task"], s["sample"]) in self.cells
        ]  # this run's tasks and samples, not a larger earlier run's


def main(cfg) -> dict:
    # ---- the model, the environment, the tasks, what is already done
    setup_process(cfg.seed, threads=None)
    out = Path(cfg.output_dir)
    lock = OutputLock(out)
    ev = cfg.eval
    specs = [PolicySpec.of(name, ev.settings) for name in dict.fromkeys(["full", *ev.policies])]
    weights = resolve_path(cfg.model.path)  # a run directory: the folder of the weights it trained
    config = AutoConfig.from_pretrained(weights)
    env, tasks = load_tasks(cfg, weights, config)
    data = bool(getattr(env, "data", None))
    # ---- what the samples depend on (module docstring): another setting's samples are refused
    settings_path = out / "settings.json"
    recorded = json.loads(settings_path.read_text()) if settings_path.exists() else {"settings": {}, "files": {}}
    kv = {
        "interval": cfg.kv.interval,
        "window": cfg.kv.window,
        "sink": cfg.kv.sink,
        "budget_ratio": cfg.kv.budget_ratio,
    }
    settings, hidden, artefacts, files = line_settings(cfg, specs, config, weights, recorded["files"], kv)
    setting = {name: digest(value) for name, value in settings.items()}
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
    print(f"kvrl: judging {which_tasks(cfg, data)}", file=sys.stderr)  # after the refusals: they come alone
    warning = stream_warning(cfg, Path(weights), data)
    if warning is not None:
        print(f"kvrl: warning: {warning}", file=sys.stderr)
    sampler = Samples(cfg, env, tasks, config, kv, setting, shas, samples_path, done)

    # ---- the full cache first: the reference, and what budget fractions are of
    full = sampler.line(specs[0], None)
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
                **summarise(sampler.line(spec, point), ev.pass_k),
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
    evaluated = {
        "model": (weights, files),
        "artefacts": artefacts,
        "kvrl": kvrl_commit(),
        "tasks": which_tasks(cfg, data),
    }
    report(cfg, env, rows, sampler.traces, mean_len, out, weights, props, evaluated)
    lock.release()
    return {"rows": rows, "mean_seq_len": mean_len}
