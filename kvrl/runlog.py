"""An output directory's life: process set-up, metrics, atomic saves, resume discovery, plots.

Every job writes under ``output_dir`` through this module, so the rules live in one place:

* :func:`setup_process` — one torch thread (actors and tests share two cores: more threads
  only contend, up to 100x slower), flushed denormals (float32 Adam on CPU slows
  several-fold once moments go subnormal), and the seed.
* :class:`RunLog` — ``metrics.jsonl``, one JSON object per line, flushed per line, mirrored
  to TensorBoard (``logging.tensorboard``) and W&B (``logging.wandb``; ``WANDB_MODE=offline``
  works without a network). :meth:`RunLog.trim` drops the rows a crashed run logged after
  its last checkpoint, so a resumed run logs every step exactly once; a torn last line
  (the process died mid-write) is dropped, never a ``JSONDecodeError``.
* :func:`atomic` — write to a temporary file beside the target and rename it over the
  target, so a crash leaves the previous file (or none), never half of one.
* :func:`latest_checkpoint` / :func:`mark_latest` — the ``checkpoints/latest`` pointer.
* :func:`pyplot` and :func:`plot_rewards` — matplotlib without a display, and the standard
  reward curve every RL job draws.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np


def setup_process(seed: int | None = None, threads: int | None = 1) -> None:
    """``threads`` torch threads (None: torch's default), denormals flushed and (when given)
    torch's RNG seeded."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    if seed is not None:
        torch.manual_seed(seed)


@contextmanager
def atomic(path: str | Path) -> Iterator[Path]:
    """``with atomic(p) as tmp: write(tmp)`` — ``tmp`` replaces ``p`` only if the block
    finished; the temporary keeps ``p``'s suffix so writers that look at it still work."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | Path, obj) -> None:
    """``obj`` as indented JSON, atomically."""
    with atomic(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1))


def save_torch(obj, path: str | Path) -> None:
    """``torch.save`` atomically."""
    import torch

    with atomic(path) as tmp:
        torch.save(obj, tmp)


def mark_latest(checkpoint: str | Path) -> None:
    """Point ``<checkpoints>/latest`` at ``checkpoint`` (a folder beside it), atomically."""
    checkpoint = Path(checkpoint)
    with atomic(checkpoint.parent / "latest") as tmp:
        tmp.write_text(checkpoint.name)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``<root>/latest`` points at; None when there is none."""
    latest = Path(root) / "latest"
    return latest.parent / latest.read_text().strip() if latest.exists() else None


class RunLog:
    """``output_dir/metrics.jsonl`` and its mirrors (see the module docstring).

    fresh: start a new log (the run starts over); otherwise rows are appended to what a
    previous run of the same ``output_dir`` wrote (call :meth:`trim` after resuming).
    """

    def __init__(self, out: str | Path, *, fresh: bool, tensorboard: bool = False, wandb: bool = False,
                 name: str = "", config: dict | None = None):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "metrics.jsonl"
        if fresh:
            self.path.unlink(missing_ok=True)
        self.writer = tensorboard_writer(self.out / "tensorboard") if tensorboard else None
        self.wandb = wandb_run(self.out, name, config) if wandb else None

    def log(self, row: dict, step: int | None = None) -> None:
        """Append ``row``; numeric values also go to TensorBoard / W&B at ``step``
        (default ``row["step"]``)."""
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        step = row.get("step") if step is None else step
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.writer is not None:
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def records(self) -> list[dict]:
        """Every row logged so far; a torn last line is dropped (and removed from the file)."""
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        rows = []
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:  # only the last line can be half-written by a crash
                    raise ValueError(f"{self.path}:{i + 1} is not JSON; the metrics file is damaged") from None
                self._rewrite(rows)
        return rows

    def trim(self, keep: Callable[[dict], bool]) -> None:
        """Keep only the rows for which ``keep(row)`` holds (resume: the checkpoint's steps)."""
        self._rewrite([r for r in self.records() if keep(r)])

    def _rewrite(self, rows: list[dict]) -> None:
        with atomic(self.path) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def tensorboard_writer(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError("logging.tensorboard=true needs the tensorboard package: `pip install tensorboard`, "
                          "or set logging.tensorboard=false (metrics.jsonl has every value)") from None
    return SummaryWriter(str(path))


def wandb_run(out: Path, name: str, config: dict | None):
    """A W&B run writing under ``out/wandb``; with no network set ``WANDB_MODE=offline``
    (``wandb sync`` uploads it later)."""
    try:
        import wandb
    except ImportError:
        raise ImportError("logging.wandb=true needs the wandb package: `pip install wandb`, or set "
                          "logging.wandb=false (metrics.jsonl has every value)") from None
    return wandb.init(dir=str(out), name=name or None, config=config, resume="allow", id=None)


def pyplot():
    """matplotlib.pyplot on the Agg backend (jobs run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rewards(records: list[dict], path: Path, title: str, *, key: str = "reward_mean",
                 std_key: str = "reward_std", count_key: str | None = "samples", ylabel: str = "reward") -> None:
    """The reward curve: per-step mean ± standard error (or ± std without ``count_key``)
    and a 5-step moving average."""
    plt = pyplot()
    steps = [r["step"] for r in records]
    mean = np.array([r[key] for r in records])
    spread = np.array([r[std_key] / (np.sqrt(r[count_key]) if count_key else 1.0) for r in records])
    window = min(5, len(mean))
    smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, mean, marker="o", ms=3, lw=0.8, label=f"{ylabel}, mean over the step's samples")
    ax.fill_between(steps, mean - spread, mean + spread, alpha=0.2,
                    label="± standard error" if count_key else "± standard deviation")
    ax.plot(steps[window - 1:], smooth, lw=2, label=f"{window}-step moving average")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
