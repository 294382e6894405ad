"""What the scripts under ``benchmarks/`` share: their models, tasks, clocks and output.

The project's rule for a benchmark: it prints one JSON line of figures measured side by side
in one run. This module is the part of that every script would otherwise write again:

* :func:`timed` — one call's CPU seconds and wall seconds. CPU is this process's, every
  thread, plus that of its children that ended and were waited for during the call (a
  subprocess a benchmark runs, a worker pool it joins); CPU time is what a shared machine's
  other load hardly moves, wall time is what a user waits.
* :func:`interleaved` — repeats of several callables taken in turns (a, b, a, b, ...), so
  that a drift in the machine's load hits each alike; each one's :class:`Runs` keeps every
  run's two times and result, :meth:`Runs.summary` their mean and spread.
* :func:`emit` — the one JSON line; :func:`record` also writes it to
  ``benchmarks/results/<name>.json`` with the commit it ran at, for the benchmarks whose
  figures take hours to remake (standard JSON: a NaN or infinite figure is written as null and
  named in ``non_finite``); :func:`accuracy` a judged accuracy with its 95 % interval.
* :func:`reasoner`, :func:`draw_tasks` and :func:`recipe_policy` — a shipped tiny reasoner in
  the reference engine, an environment's task stream at a seed, and a recipe's ``kv``
  section as a policy.
* :func:`synthetic_death` and :func:`register_dense_masks` — a G-KV-like eviction trace of
  any length and the reference repos' training attention (dense per-layer masks), which
  the replay benchmarks set against kvrl's replay.

It lives in the package, not in ``benchmarks/``, so that ``python benchmarks/<group>/<x>.py``
finds it wherever kvrl is importable (installed, or ``PYTHONPATH=.``) without touching
``sys.path``.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvrl.kernels import NEVER

ROOT = Path(__file__).resolve().parent.parent  # the checkout: its git state, and benchmarks/results/


def _clock() -> tuple[float, float]:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime, time.perf_counter()


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(CPU seconds, wall seconds, result) of ``fn()``."""
    cpu, wall = _clock()
    out = fn()
    cpu_end, wall_end = _clock()
    return cpu_end - cpu, wall_end - wall, out


@dataclass
class Runs:
    """One callable's repeats: CPU and wall seconds and the result of each run, in order."""

    cpu_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    outs: list = field(default_factory=list)

    def summary(self, digits: int = 4) -> dict:
        """{"cpu_s": spread, "wall_s": spread} (:func:`spread`)."""
        return {"cpu_s": spread(self.cpu_s, digits), "wall_s": spread(self.wall_s, digits)}


def spread(values: list[float], digits: int = 4) -> dict:
    """{"mean", "min", "max"} of repeated measurements, rounded to ``digits``."""
    return {
        "mean": round(statistics.mean(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Runs]:
    """Every callable ``repeats`` times, in turns; {name: its :class:`Runs`}. A result is kept
    for each run: a callable whose result is large returns None and keeps what it needs."""
    runs = {name: Runs() for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            cpu, wall, out = timed(fn)
            runs[name].cpu_s.append(cpu)
            runs[name].wall_s.append(wall)
            runs[name].outs.append(out)
    return runs


def emit(record: dict) -> None:
    """The benchmark's one JSON line, flushed (a caller may be reading the pipe)."""
    print(json.dumps(record), flush=True)


def accuracy(result: dict) -> dict:
    """{"acc", "ci95", "query_acc" where the environment reports it, "n"} of an
    :func:`kvrl.eval.budgets.evaluate` result: the exact answer's share with its 95 % Wilson
    interval over tasks."""
    from kvrl.eval.suite import wilson

    n = len(result["rewards"])
    line = {"acc": round(result["acc"], 4), "ci95": [round(x, 4) for x in wilson(result["acc"], n)], "n": n}
    if "query_acc" in result["metrics"]:
        line["query_acc"] = round(result["metrics"]["query_acc"], 4)
    return line


# The multihop reasoner's held-out task streams (training draws from seed 0's): choices of reward and
# hyperparameters look at the validation stream only, and every formulation is judged on the test stream.
VALIDATION_SEED, TEST_SEED = 7001, 9001


# Student's t at 0.975 for 1..30 degrees of freedom (beyond 30 within 2 % of the normal's 1.96)
T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def mean_interval(values: list[float], tasks: int, digits: int = 4) -> dict:
    """{"mean", "ci95", "sd", "n"} of accuracies of independent repeats (training seeds, head sets drawn at
    random), each judged on the same ``tasks`` tasks: the mean with Student's t interval over the repeats,
    widened to at least the Wilson interval of the pooled ``n x tasks`` judgements and clipped to [0, 1].
    The repeats are the trials: tasks under one seed or head set are not independent of each other, so
    the pooled interval alone is far too narrow; it only keeps repeats that all agree (all 0, say) from
    giving an interval of width 0."""
    from kvrl.eval.suite import wilson

    n = len(values)
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if n > 1 else math.nan
    half = T975[min(n - 1, len(T975)) - 1] * sd / math.sqrt(n) if n > 1 else math.inf
    pooled = wilson(mean, n * tasks)
    ci = [max(0.0, min(mean - half, pooled[0])), min(1.0, max(mean + half, pooled[1]))]
    return {"mean": round(mean, digits), "ci95": [round(x, digits) for x in ci], "sd": round(sd, digits), "n": n}


def streams(stream_seed: int, train_seed: int, commits, validation_seed: int | None = VALIDATION_SEED) -> dict:
    """What a multihop results line says of its data and code: the stream it was judged on, the training
    stream's seed and the commits that trained it, the validation stream choices looked at (None: no choice
    looked at any stream) and the test stream."""
    return {
        "stream_seed": stream_seed,
        "train_seed": train_seed,
        "train_commits": commits,
        "validation_seed": validation_seed,
        "test_seed": TEST_SEED,
    }


def save_figure(fig, path: Path) -> None:
    """A benchmark's picture, laid out and written to ``path`` (its folder made), then closed."""
    from kvrl.runlog import pyplot

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def train_commits(run: str | Path) -> list[str]:
    """The kvrl commits that trained the run in folder ``run``, in order, each once (a resumed run may
    have more than one): what its :class:`kvrl.runlog.RunLog` noted at each start; ``["unknown"]``
    for a run trained before runs noted it."""
    from kvrl.runlog import COMMITS

    path = Path(run) / COMMITS
    lines = path.read_text().split("\n") if path.exists() else []
    return list(dict.fromkeys(line for line in lines if line)) or ["unknown"]


def column_mean(rows: list[dict], key: str, digits: int = 4) -> float | None:
    """The mean of ``key`` over the metrics rows (one per training step) that logged it, rounded; None if none did."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.fmean(values), digits) if values else None


def error_bars(points: list[dict]) -> list[list[float]]:
    """matplotlib's asymmetric ``yerr`` of points ``{"acc", "ci95": [lo, hi]}``: [below, above]."""
    return [[p["acc"] - p["ci95"][0] for p in points], [p["ci95"][1] - p["acc"] for p in points]]


def record(name: str, line: dict) -> None:
    """:func:`emit` ``line`` and write it to ``benchmarks/results/<name>.json`` with the commit of the
    code that ran: ``-dirty`` when the tree differed from it (:func:`dirty_files`, listed in
    ``dirty_files``). A NaN or infinite value is written as null, and named with its value in
    ``non_finite`` (``{"training.mismatch_max": "inf"}``): the file stays standard JSON, and a
    reader can tell such a null from a figure that was not measured."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = commit or "unknown"
    dirty = dirty_files(ROOT)
    non_finite: dict[str, str] = {}
    line = {
        **finite(line, "", non_finite),
        "commit": commit + ("-dirty" if dirty else ""),
        "date": time.strftime("%Y-%m-%d"),
    }
    if non_finite:
        line["non_finite"] = non_finite
    if dirty:  # which files differed from the commit: a reader can tell whether the code that ran did
        line["dirty_files"] = dirty
    emit(line)
    out = ROOT / "benchmarks" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(line, indent=1, allow_nan=False) + "\n")


def dirty_files(root: Path) -> list[str]:
    """The files of the git checkout ``root`` that differ from its commit: tracked files with changes,
    and files git does not know (and does not ignore) under ``kvrl/`` and ``benchmarks/``, which a
    benchmark may have imported. Results (``benchmarks/results/``), tracked or not, are outputs, not code:
    a checkout that judges one benchmark after another stays clean."""

    def rows(*args: str) -> list[str]:
        return subprocess.run(
            ["git", "status", "--porcelain", *args], cwd=root, capture_output=True, text=True
        ).stdout.splitlines()

    outputs = ":(exclude)benchmarks/results"
    tracked = [row[3:] for row in rows("--untracked-files=no", "--", ".", outputs)]
    scope = ("--", "kvrl", "benchmarks", outputs)
    return tracked + [row[3:] for row in rows("--untracked-files=all", *scope) if row.startswith("??")]


def finite(value: Any, where: str, non_finite: dict[str, str]) -> Any:
    """``value`` with every NaN or infinite float in it (through dicts and lists) replaced by None,
    each recorded in ``non_finite`` by its path (``a.b[1]``) and value."""
    if isinstance(value, float) and not math.isfinite(value):
        non_finite[where] = str(value)
        return None
    if isinstance(value, dict):
        return {k: finite(v, f"{where}.{k}" if where else str(k), non_finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v, f"{where}[{i}]", non_finite) for i, v in enumerate(value)]
    return value


def reasoner(path: str = "tiny", **kwargs):
    """(model, tokenizer, HF reference engine) of a shipped reasoner or a trained folder."""
    from kvrl.engines.hf import HFEngine
    from kvrl.models.tiny import load_model

    model, tok = load_model(path, **kwargs)
    return model, tok, HFEngine(model, tok)


def evaluate_under_recipe(path: str, cfg, env, tasks) -> dict:
    """:func:`kvrl.eval.budgets.evaluate`'s result for the model at ``path`` (a shipped reasoner or a
    trained folder): greedy on ``tasks`` under the cache of the recipe ``cfg``'s ``kv`` section."""
    from kvrl.eval.budgets import evaluate

    model, _, engine = reasoner(path)
    policy = recipe_policy(cfg.kv.policy, model.config, cfg.kv)
    return evaluate(engine, env, tasks, cfg.sampling.max_new_tokens, policy=policy)


def draw_tasks(env_id: str, n: int, seed: int, **kwargs):
    """(environment, its first ``n`` tasks after ``reset(seed)``): the same tasks for every
    line a benchmark compares; training runs draw from seed 0's stream, so held-out sets
    use another seed."""
    from kvrl.envs import make

    env = make(env_id, **kwargs)
    env.reset(seed=seed)
    return env, env.tasks(n)


def recipe_policy(name: str, config, kv):
    """Policy ``name`` at a recipe's ``kv`` section (budget, interval, window, sink, kwargs)."""
    from kvrl.policies import make_policy

    return make_policy(
        name, config, budget=kv.budget, interval=kv.interval, window=kv.window, sink=kv.sink, **kv.kwargs
    )


def synthetic_death(layers: int, heads: int, T: int, sink: int = 4, recent: int = 16, seed: int = 0) -> torch.Tensor:
    """[layers, 1, heads, T] int32 death times of a G-KV-like trace: the sink never dies, each
    other key dies at a random query in (k + recent, T], or never (about a quarter of them).
    What replaying costs does not depend on which keys die."""
    g = torch.Generator().manual_seed(seed)
    k = torch.arange(T)
    death = k + recent + (torch.rand(layers, 1, heads, T, generator=g) * (T - k)).long()
    death = torch.where(torch.rand(layers, 1, heads, T, generator=g) < 0.25, NEVER, death)
    return death.masked_fill(k < sink, NEVER).clamp(max=NEVER).int()


def _dense_mask_attention(
    module, query, key, value, attention_mask, *, scaling, dropout=0.0, dense_masks=None, **kwargs
):
    groups = query.shape[1] // key.shape[1]
    mask = dense_masks[module.layer_idx].repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_dense_masks() -> str:
    """Registers the reference repos' training attention, a stored [layers, B, H_kv, T, T]
    bool mask per forward (``model(..., dense_masks=masks)``), and returns its name for
    ``model.set_attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register("bench_dense_mask", _dense_mask_attention)
    return "bench_dense_mask"
