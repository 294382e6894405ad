"""Answer checking with math-verify under a hard per-answer timeout, safe from any thread.

Why a worker process: math-verify's own timeouts use ``signal.alarm``, which raises
``ValueError`` outside the main thread (thread pools, Ray actors' threads), and no signal can
stop a computation stuck inside C code. So ``parse`` / ``verify`` run in one small,
persistent subprocess per parent process, started lazily and reused. In its main thread each
request runs under a ``setitimer`` budget of 0.8 x the timeout; the parent waits with a
wall-clock deadline of the full timeout, and past it kills the worker (the next call starts
a new one). Either way the answer counts as wrong and the verdict says ``timed_out``. The
time to start a worker (about 1 s) is not charged to the answer that triggers it.

The worker is a fresh interpreter (``python -c``), not a ``multiprocessing`` child: it never
re-imports the caller's ``__main__`` script (spawn/forkserver do), and nothing is forked from
a multi-threaded parent. It reads JSON lines on stdin, answers on the original stdout, and
exits when the parent closes the pipe. The parent never imports math-verify or sympy.

API: :func:`math_equal`, :func:`check_answer` (also says whether it timed out),
:func:`extract_boxed`, :func:`shutdown`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STARTUP_TIMEOUT = 120.0  # seconds for a fresh worker to import math-verify (not per answer)


@dataclass(frozen=True)
class Verdict:
    """``equal``: the answers match; ``timed_out``: checking hit a timeout (``equal`` is False)."""

    equal: bool
    timed_out: bool = False


def math_equal(gold: str, pred: str, timeout: float = 5.0) -> bool:
    """Whether ``pred`` is mathematically equal to ``gold`` (both answer strings, e.g.
    ``"\\frac{1}{2}"`` and ``"0.5"``). ``False`` past ``timeout`` seconds."""
    return check_answer(gold, pred, timeout).equal


def check_answer(gold: str, pred: str, timeout: float = 5.0) -> Verdict:
    """Like :func:`math_equal` but reports timeouts. Thread-safe; calls are serialised."""
    return _WORKER.check(gold, pred, timeout)


def shutdown() -> None:
    """Stop this process's worker (a later call starts a new one)."""
    _WORKER.stop()


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces.

    ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``; ``"\\boxed 5"`` -> ``"5"``;
    ``None`` when there is none or the last one is unclosed (a truncated output).
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i):  # "\boxed 5": up to the next whitespace or "$"
        rest = text[i + 1 :].lstrip()
        end = next((k for k, c in enumerate(rest) if c.isspace() or c == "$"), len(rest))
        return rest[:end] or None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


# ---- parent side -----------------------------------------------------------------------


class _Worker:
    """Owns the subprocess and the lock around its pipes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buf = b""

    def check(self, gold: str, pred: str, timeout: float) -> Verdict:
        request = json.dumps({"gold": gold, "pred": pred, "timeout": timeout}).encode() + b"\n"
        with self._lock:
            for _ in range(2):  # one retry when the worker died between calls
                self._ensure_started()
                try:
                    self._proc.stdin.write(request)
                    self._proc.stdin.flush()
                except (BrokenPipeError, OSError):
                    self._kill()
                    continue
                try:
                    line = self._read_line(time.monotonic() + timeout)
                except EOFError:  # the worker died (OOM killer, segfault): retry once
                    self._kill()
                    continue
                if line is None:  # over the deadline: kill it, the next call restarts it
                    self._kill()
                    return Verdict(False, timed_out=True)
                reply = json.loads(line)
                return Verdict(bool(reply["equal"]), bool(reply["timed_out"]))
            return Verdict(False)

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._kill()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so the worker imports this kvrl
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self._proc = subprocess.Popen(
            _worker_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True
        )
        self._buf = b""
        try:
            ready = self._read_line(time.monotonic() + STARTUP_TIMEOUT)
        except EOFError:
            ready = None
        if ready is None or not json.loads(ready).get("ready"):
            self._kill()
            raise RuntimeError(
                f"the math-verify worker did not start; run `{sys.executable} -c 'import math_verify'` to see why"
            )

    def _read_line(self, deadline: float) -> bytes | None:
        """One line from the worker's stdout; None at the deadline, EOFError if it exited."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("math-verify worker exited")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _kill(self) -> None:
        proc, self._proc, self._buf = self._proc, None, b""
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def stop(self) -> None:
        with self._lock:
            self._kill()

    def after_fork_in_child(self) -> None:
        """A forked child gets a fresh lock and closes its copies of the parent's pipes
        (so the parent's worker still sees EOF when the parent exits)."""
        self._lock = threading.Lock()
        proc, self._proc, self._buf = self._proc, None, b""
        for stream in (proc.stdin, proc.stdout) if proc is not None else ():
            try:
                stream.close()
            except OSError:
                pass


def _worker_argv() -> list[str]:
    return [sys.executable, "-c", "from kvrl.envs.verify import _worker_main; _worker_main()"]


_WORKER = _Worker()
atexit.register(_WORKER.stop)
os.register_at_fork(after_in_child=_WORKER.after_fork_in_child)


# ---- worker side -----------------------------------------------------------------------


class _OverBudget(BaseException):
    """Raised by the worker's timer; a BaseException so math-verify does not swallow it."""


def _on_timer(signum, frame):
    raise _OverBudget


def _equal(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None) or parse(pred, parsing_timeout=None)
    return bool(g and p and verify(g, p, timeout_seconds=None))


def _worker_main() -> None:
    """Serve ``{"gold", "pred", "timeout"}`` requests, one JSON line each, until EOF.

    Each request runs under one ``setitimer`` budget of 0.8 x its timeout (float seconds,
    in this process's main thread) in place of math-verify's per-call whole-second alarms,
    so the parent's hard kill is only needed for computations stuck in C code.
    """
    # The protocol owns the original stdout; stray prints (ours or C code's) go to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGALRM, _on_timer)
    # math-verify logs whole inputs at warning level; its alarms are off (we time requests).
    mv_logger = logging.getLogger("math_verify")
    mv_logger.addHandler(logging.NullHandler())
    mv_logger.propagate = False
    mv_logger.setLevel(logging.ERROR)
    _equal("1", "1")  # import and warm up sympy / latex2sympy before saying ready

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    reply({"ready": True})
    for raw in sys.stdin.buffer:
        req = json.loads(raw)
        equal, timed_out = False, False
        try:
            signal.setitimer(signal.ITIMER_REAL, max(0.8 * float(req["timeout"]), 1e-3))
            try:
                equal = _equal(req["gold"], req["pred"])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _OverBudget:
            equal, timed_out = False, True
        except Exception:
            equal = False
        reply({"equal": equal, "timed_out": timed_out})
