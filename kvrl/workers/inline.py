"""``workers.address=inline``: a run's actors as plain objects in the driver's process, no Ray.

On a few cores most of a short run's start-up is processes: each Ray actor imports torch and
transformers again and Ray's daemons start (``benchmarks/system/trl_compare.py`` measures it).
Inline, the same controller drives the same actor classes, in one process, with one import.

The contract: :func:`spawn` gives a handle with a Ray actor's call shape,
``handle.method.remote(*args)``, whose call runs there and then and returns a :class:`Done`
(two for a ``@ray.method(num_returns=2)`` method); :func:`kvrl.workers.controller.get` reads
it as it reads an object ref, and a call given one receives its value, as on Ray. Arguments
and results are deep-copied, as Ray's object store copies them: a learner's in-place
optimizer step must not reach the weights a rollout worker was given, nor a worker's edit the
controller's samples. So a run gives the same samples and metrics inline as on Ray
(``tests/test_rl_loop.py``).

What the actors print (vLLM's and DeepSpeed's start-up, their warnings, C++ lines included) goes,
as on Ray, to a log file rather than the console, unless ``logging.verbose``: :func:`output_to`
points the process's stdout and stderr at it for the length of each call.

What Ray gives and this does not: actors run one after another, not in parallel; nothing is
restarted (an actor's exception is the run's, with its own traceback, at the call); no call
times out; one learner only (a process group needs a process per rank).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INLINE = "inline"  # the workers.address that selects it


@dataclass(frozen=True)
class Done:
    """The result of a call that has run."""

    value: Any


@contextlib.contextmanager
def output_to(log: Path | None):
    """File descriptors 1 and 2 appended to ``log`` inside the block (None: left alone), so that
    C and C++ lines go there with Python's prints, warnings and log records."""
    if log is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(log, "ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


class Method:
    """``handle.method``: ``.remote(*args)`` runs it now."""

    def __init__(self, fn, log: Path | None):
        self.fn, self.log, self.returns = fn, log, getattr(fn, "__ray_num_returns__", 1)

    def remote(self, *args):
        args = [a.value if isinstance(a, Done) else a for a in args]  # Ray passes a ref argument's value
        with output_to(self.log):
            out = copy.deepcopy(self.fn(*copy.deepcopy(args)))
        return Done(out) if self.returns == 1 else tuple(Done(v) for v in out)


class Actor:
    """An instance of a ``@ray.remote`` class's own class, called as Ray's handles are; what it
    prints goes to ``log`` (None: the console)."""

    def __init__(self, remote_cls, *args, log: Path | None = None):
        self.log = log
        with output_to(log):
            self.obj = remote_cls.__ray_actor_class__(*copy.deepcopy(args))

    def __getattr__(self, name: str) -> Method:
        return Method(getattr(self.obj, name), self.log)


def spawn(remote_cls, options: dict, *args, inline: bool, log: Path | None = None):
    """An actor of ``remote_cls`` (a ``@ray.remote`` class): on Ray with ``options``, or inline
    printing to ``log``."""
    return Actor(remote_cls, *args, log=log) if inline else remote_cls.options(**options).remote(*args)
