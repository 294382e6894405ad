"""An output directory's life: process set-up, metrics, atomic saves, resume discovery, plots.

Every job writes under ``output_dir`` through this module, so the rules live in one place:

* :func:`setup_process` — one torch thread (actors and tests share two cores: more threads
  only contend, up to 100x slower), flushed denormals (float32 Adam on CPU slows
  several-fold once moments go subnormal), and the seed.
* :class:`RunLog` — ``metrics.jsonl``, one standard JSON object per line (a NaN or inf is
  written as ``null``: ``json.loads`` elsewhere refuses ``NaN``), flushed per line, mirrored
  to TensorBoard (``logging.tensorboard``) and W&B (``logging.wandb``; ``WANDB_MODE=offline``
  works without a network). :meth:`RunLog.trim` drops the rows a crashed run logged after
  its last checkpoint, so a resumed run logs every step exactly once; a torn last line
  (the process died mid-write) is dropped, never a ``JSONDecodeError``.
* :func:`atomic` — write to a temporary file beside the target and rename it over the
  target, so a crash leaves the previous file (or none), never half of one.
* :class:`OutputLock` — one run per output directory: an exclusive ``flock`` on
  ``output_dir/.lock``, which the kernel drops when the process ends however it ends, so
  the lock of a dead run is never stale; :func:`lock_holder` says who holds it.
* Checkpoints verify themselves: :func:`seal` writes ``SHA256SUMS`` (every file of a
  checkpoint folder) after the files and before :func:`mark_latest` points at it;
  :func:`intact_checkpoint` returns the newest checkpoint whose files match, warning about
  each newer one that does not (a flipped bit, a truncated file, a crash mid-save, a bad
  ``latest`` pointer). :func:`config_changes` lists what a resumed run changed.
* A run that trains model weights leaves them as sealed transformers folders: ``model/``
  in each checkpoint and ``output_dir/model`` at its end. :func:`trained_model` finds them,
  so that ``model.path=<output_dir>`` loads what a run trained.
* :func:`pyplot` and :func:`plot_rewards` — matplotlib without a display, and the standard
  reward curve every RL job draws.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np


def setup_process(seed: int | None = None, threads: int | None = 1) -> None:
    """``threads`` torch threads (None: torch's default), denormals flushed and (when given)
    torch's RNG seeded."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    # numpy measures each float type's limits once, lazily; measured after the flush it finds a
    # smallest subnormal of 0 and warns about it in every process that asks (pandas, matplotlib)
    for kind in (np.float16, np.float32, np.float64):
        _ = np.finfo(kind).smallest_subnormal
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
        with disk_full_names(path):
            yield tmp
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# how torch.save's C++ writer reports a failed write (ENOSPC among them): a RuntimeError without an errno
TORCH_WRITE_FAILED = ("basic_ios::clear", "file write failed", "PytorchStreamWriter failed writing", "unexpected pos")


@contextmanager
def disk_full_names(path: str | Path) -> Iterator[None]:
    """Re-raise "no space left on device" with the file that could not be written, as an OSError
    (ENOSPC); torch.save's own report of a failed write too. ``path``: the file written, or the folder
    whose files are (the error's own file name, when it has one, is named instead)."""
    fix = "free space there or point output_dir at a larger disk (resume=auto continues the run)"
    try:
        yield
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        raise OSError(errno.ENOSPC, f"no space left on device while writing {err.filename or path}: {fix}") from err
    except RuntimeError as err:
        if not any(sign in str(err) for sign in TORCH_WRITE_FAILED):
            raise
        where = next(p for p in Path(path).absolute().parents if p.exists())
        free = shutil.disk_usage(where).free / 2**20
        raise OSError(
            errno.ENOSPC,
            f"writing {path} failed (torch.save: {str(err).splitlines()[0]}), which is how "
            f"it reports a full disk ({free:.0f} MiB free on {where} now): {fix}",
        ) from err


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


SUMS = "SHA256SUMS"
# where a job=foresight run keeps its trained scorer, the later stage first
SCORER_FILES = ("rl/scorer.safetensors", "sft/scorer.safetensors")
COMMITS = "commits.txt"  # a run folder's: the kvrl commit of each start (kvrl_commit), one a line


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's content, hex (read in blocks: weights can be gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def seal(folder: str | Path) -> None:
    """Write ``folder/SHA256SUMS`` (``sha256sum`` format) over every file below ``folder``."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != SUMS and not p.name.startswith("."))
    with atomic(folder / SUMS) as tmp:
        tmp.write_text("".join(f"{sha256_of(p)}  {p.relative_to(folder)}\n" for p in files))


WEIGHTS = ("*.safetensors", "*.bin", "*.pt")  # what a sealed folder's SHA256SUMS must list: what a load reads


def damage(folder: str | Path, only: str | None = None) -> str | None:
    """Why ``folder`` is not an intact sealed folder, or None when every file matches.
    Its SHA256SUMS names only files inside it and lists every weight file below it (:data:`WEIGHTS`, as
    :func:`seal` writes it): a line dropped or pointed elsewhere would let a damaged file load unchecked.
    ``only``: check that one file (a name in ``folder``), which its SHA256SUMS must list."""
    folder = Path(folder)
    sums = folder / SUMS
    if not sums.is_file():
        return f"no {SUMS} (the save did not finish)"
    lines = (line.partition("  ") for line in sums.read_text().splitlines())
    listing = {name: digest for digest, _, name in lines}
    outside = next((n for n in listing if Path(n).is_absolute() or ".." in Path(n).parts), None)
    if outside is not None:
        return f"{sums} names {outside!r}, a file outside {folder}; a {SUMS} lists only files inside its folder"
    if only is None:
        weights = sorted(p for pattern in WEIGHTS for p in folder.rglob(pattern) if p.is_file())
        unlisted = [p for p in weights if not p.name.startswith(".") and str(p.relative_to(folder)) not in listing]
        if unlisted:
            return f"{unlisted[0]} is not listed in {sums}, which must list every weight file below its folder"
    elif only not in listing:
        return f"{folder / only} is not listed in {sums}, which seals that folder"
    for name, digest in listing.items() if only is None else [(only, listing[only])]:
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if sha256_of(path) != digest:
            return f"{path} does not match its checksum in {sums}"
    return None


def intact_checkpoint(root: str | Path, verify: bool = True) -> Path | None:
    """The newest intact checkpoint folder under ``root``, by step: ``latest`` is not trusted
    over a newer sealed one (a crash between :func:`seal` and :func:`mark_latest` leaves
    exactly that). A warning for every damaged one skipped and for a ``latest`` pointing nowhere.
    ``verify=False``: the newest sealed one, silently, without reading its files (the config gate's
    look before the job resumes)."""
    root = Path(root)
    if not root.is_dir():
        return None
    latest = latest_checkpoint(root)
    if verify and latest is not None and not latest.is_dir():
        print(f"kvrl: warning: {latest} does not exist ({root / 'latest'} points at it)", file=sys.stderr)
    for folder in sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True):  # step_NNNNNN: by step
        if not verify:
            if (folder / SUMS).is_file():
                return folder
            continue
        why = damage(folder)
        if why is None:
            return folder
        print(f"kvrl: warning: skipping checkpoint {folder}: {why}", file=sys.stderr)
    return None


def trained_model(run: str | Path, verify: bool = True) -> tuple[Path, str] | None:
    """The transformers folder of the model weights the run in ``run`` (its ``output_dir``)
    trained, and a note saying which one it is; None when ``run`` is no kvrl run directory.

    The final export ``run/model`` when it is sealed, else the sealed ``model/`` of the
    newest sealed checkpoint (by step, as :func:`intact_checkpoint` chooses):
    a run that is still going, or died, gives its last saved weights. ``verify``: check the
    folder's files against its SHA256SUMS (reads them all; a damaged one is skipped with a
    warning, as resume does), else only that it was sealed (the config gate: no reading).
    Raises ValueError naming what to pass instead when the run holds no model weights: RLKV's
    gates and a ForesightKV scorer are cache policies of job=eval, not models.
    """
    run = Path(run)

    def unsealed(folder: Path) -> str | None:
        if not folder.is_dir():
            return "not written"
        if verify:
            return damage(folder)
        return None if (folder / SUMS).is_file() else f"no {SUMS} (the save did not finish)"

    final = run / "model"
    why = unsealed(final)
    if why is None:
        return final, f"its final model {final}"
    if final.is_dir() and verify and (final / SUMS).is_file():
        print(f"kvrl: warning: skipping {final}: {why}", file=sys.stderr)
    root = run / "checkpoints"
    folders = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    for folder in folders:
        if not (folder / SUMS).is_file():  # the checkpoint itself did not finish
            continue
        bad = unsealed(folder / "model")
        if bad is None:
            return folder / "model", (
                f"its newest complete checkpoint's model {folder / 'model'} (no final model: {final}: {why})"
            )
        if (folder / "model").is_dir():
            print(f"kvrl: warning: skipping checkpoint {folder}: {bad}", file=sys.stderr)
    # no weights: say what the run is, from its files and its checkpoints' config (ForesightKV's under rl/)
    saved = next(
        (
            json.loads(f.read_text())
            for r in (root, run / "rl" / "checkpoints")
            for f in sorted(r.glob("step_*/config.json"), reverse=True)
        ),
        {},
    )
    base = f"model.path={saved['model.path']}" if "model.path" in saved else "model.path=<the model it trained on>"
    if (run / "gates.safetensors").is_file() or saved.get("job") == "rlkv":
        raise ValueError(
            f"{run} is an RLKV run: it trained per-head gates, not model weights. Its gates are a cache "
            f"policy of job=eval: set {base} and eval.settings.NAME='{{policy: heads, run: {run}}}' "
            "with NAME in eval.policies"
        )
    if saved.get("job") == "foresight" or any((run / p).is_file() for p in ("scorer.safetensors", *SCORER_FILES)):
        raise ValueError(
            f"{run} is a ForesightKV run: it trained an eviction scorer, not model weights. Its scorer "
            f"is a cache policy of job=eval: set {base} and eval.settings.NAME='{{policy: learned, run: "
            f"{run}}}' with NAME in eval.policies"
        )
    if not (final.is_dir() or folders or (run / "metrics.jsonl").is_file()):
        return None
    whole = f"; a folder you know to be whole loads as model.path={final}" if final.is_dir() else ""
    raise ValueError(
        f"{run} holds no trained model yet: {final}: {why}, and no complete checkpoint holds a sealed "
        f"model/ folder (an RL job writes one at every rl.checkpoint_every steps and at its end); wait "
        f"for one, or finish the run (rerun it with output_dir={run}: resume=auto continues it){whole}"
    )


def flatten(cfg, prefix: str = "") -> dict:
    """A dataclass config as {dotted key: value}: what a checkpoint's config.json and W&B record. A
    value read from the environment is recorded as its ``${oc.env:NAME}`` reference
    (``cfg.env_references``, :func:`kvrl.config.load_config`): a secret is never written."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    if not prefix:
        out.update(getattr(cfg, "env_references", {}))
    return out


def config_changes(saved: dict, now: dict, resumable: tuple[str, ...]) -> list[str]:
    """``key: saved -> now`` for every key that differs and is not in ``resumable`` (keys, or
    sections given with their trailing dot)."""
    changed = []
    for key in sorted(saved.keys() | now.keys()):
        if key in resumable or any(r.endswith(".") and key.startswith(r) for r in resumable):
            continue
        if saved.get(key) != now.get(key):
            changed.append(f"{key}: {saved.get(key)!r} -> {now.get(key)!r}")
    return changed


def resume_changes(saved: dict, now: dict, resumable: tuple[str, ...], resume: str, checkpoint: Path) -> list[str]:
    """:func:`config_changes` of a run that resumes ``checkpoint`` (whose config.json is ``saved``) with
    ``resume`` (auto, or the checkpoint's path). ``output_dir`` is compared by the folder it names: a
    symlink to the run's folder, or another spelling of its path, is the same run. A run folder that was
    copied or moved is another folder: resume=auto refuses it, naming the key that accepts it, and a
    checkpoint named by path (``resume=PATH``) continues into this output_dir whatever folder wrote it
    (only read: nothing of the other folder is written or mixed in)."""
    named = resume not in ("auto", "never")
    changed = config_changes(saved, now, (*resumable, *(("output_dir",) if named else ())))
    before, after = saved.get("output_dir"), now.get("output_dir")
    if named or before == after or not isinstance(before, str) or not isinstance(after, str):
        return changed
    line = f"output_dir: {before!r} -> {after!r}"
    if Path(before).expanduser().resolve() == Path(after).expanduser().resolve():
        return [c for c in changed if c != line]
    return [
        c
        if c != line
        else f"{line} (this folder holds a run written as output_dir={before}: copied or moved "
        f"here; to continue it here, set resume={checkpoint}, which continues that checkpoint into this "
        "output_dir)"
        for c in changed
    ]


class OutputLock:
    """This process's exclusive hold on ``out`` (see the module docstring); ``release()``."""

    def __init__(self, out: str | Path):
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / ".lock", "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise RuntimeError(
                f"output_dir {out} is in use by another run ({holder}): wait for it to end, or give "
                "this run its own output_dir=..."
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}")
        self.file.flush()

    def release(self) -> None:
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def lock_holder(out: str | Path) -> str | None:
    """Who holds ``out``'s :class:`OutputLock` now ("pid N on HOST"), None when no live process does
    (the config gate asks before a run starts: ``out`` is not created, the lock is held only to ask)."""
    path = Path(out) / ".lock"
    if not path.is_file():
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def kvrl_commit() -> str:
    """The git commit of the kvrl that runs (``+ uncommitted changes`` when its checkout has any), or
    ``unknown`` when kvrl is not a git checkout (an installed wheel; a repository kvrl merely sits in,
    such as a project's venv, is not kvrl's)."""
    here = Path(__file__).resolve().parent  # kvrl/

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


def scorer_file(run) -> Path | None:
    """The trained ForesightKV scorer ``run`` names: the file itself, else the run folder's
    :data:`SCORER_FILES`; None if none is there."""
    run = Path(str(run)).expanduser()
    return next((p for p in (run, *(run / f for f in SCORER_FILES)) if p.is_file()), None)


class RunLog:
    """``output_dir/metrics.jsonl`` and its mirrors (see the module docstring).

    fresh: start a new log (the run starts over); otherwise rows are appended to what a
    previous run of the same ``output_dir`` wrote (call :meth:`trim` after resuming).
    """

    def __init__(
        self,
        out: str | Path,
        *,
        fresh: bool,
        tensorboard: bool = False,
        wandb: bool = False,
        name: str = "",
        config: dict | None = None,
    ):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "metrics.jsonl"
        if fresh:
            self.path.unlink(missing_ok=True)
            (self.out / COMMITS).unlink(missing_ok=True)
        with open(self.out / COMMITS, "a") as f:  # the code of each start: what trained the run, resumes included
            f.write(kvrl_commit() + "\n")
        self.writer = tensorboard_writer(self.out / "tensorboard") if tensorboard else None
        self.wandb = wandb_run(self.out, name, config, fresh) if wandb else None

    def log(self, row: dict, step: int | None = None) -> None:
        """Append ``row``; numeric values also go to TensorBoard / W&B at ``step``
        (default ``row["step"]``); a non-finite float is written to the file as null."""
        standard = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(standard, allow_nan=False) + "\n")
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
        raise ImportError(
            "logging.tensorboard=true needs the tensorboard package: `pip install tensorboard`, "
            "or set logging.tensorboard=false (metrics.jsonl has every value)"
        ) from None
    return SummaryWriter(str(path))


def wandb_run(out: Path, name: str, config: dict | None, fresh: bool):
    """A W&B run writing under ``out/wandb``, the same run again when a run is resumed;
    with no network set ``WANDB_MODE=offline`` (``wandb sync`` uploads it later)."""
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "logging.wandb=true needs the wandb package: `pip install wandb`, or set "
            "logging.wandb=false (metrics.jsonl has every value)"
        ) from None
    id_file = out / "wandb" / "run_id"
    if fresh or not id_file.exists():
        with atomic(id_file) as tmp:
            tmp.write_text(secrets.token_hex(4))
    return wandb.init(dir=str(out), name=name or None, config=config, id=id_file.read_text(), resume="allow")


def pyplot():
    """matplotlib.pyplot on the Agg backend (jobs run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rewards(
    records: list[dict],
    path: Path,
    title: str,
    *,
    key: str = "reward_mean",
    std_key: str = "reward_std",
    count_key: str | None = "samples",
    ylabel: str = "reward",
) -> None:
    """The reward curve: per-step mean ± standard error (or ± std without ``count_key``)
    and a 5-step moving average once it has two points (six steps: one point of a line draws
    nothing, and its legend entry would name a line that is not there). A step that logged no reward
    (null, as a Distill step of an older kvrl did) is a gap in the line."""
    plt = pyplot()
    steps = [r["step"] for r in records]

    def value(r: dict, k: str) -> float:
        return np.nan if r.get(k) is None else float(r[k])

    mean = np.array([value(r, key) for r in records])
    spread = np.array([value(r, std_key) / (np.sqrt(r[count_key]) if count_key else 1.0) for r in records])
    window = 5
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, mean, marker="o", ms=3, lw=0.8, label=f"{ylabel}, mean over the step's samples")
    ax.fill_between(
        steps,
        mean - spread,
        mean + spread,
        alpha=0.2,
        label="± standard error" if count_key else "± standard deviation",
    )
    if len(mean) > window:
        smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, lw=2, label=f"{window}-step moving average")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
