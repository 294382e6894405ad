"""Every monkeypatch kvrl applies around vLLM, each a named function (there is one).

kvrl's backends, KV-cache spec and worker extension go through vLLM's registries and
extension points and need no patch. The one exception undoes a side effect of vLLM's CPU
worker on the *calling* process when vLLM runs in-process:

* :func:`restore_torch_set_num_threads` — ``CPUWorker.init_device`` replaces
  ``torch.set_num_threads`` with a function that only logs a warning (vllm 0.32,
  ``v1/worker/cpu_worker.py``). In-process that silently disables thread control for the
  rest of the program (the HF engine, the learner); kvrl puts the original back once the
  engine is built.
"""

from __future__ import annotations

import contextlib

import torch

_ORIGINAL_SET_NUM_THREADS = torch.set_num_threads


@contextlib.contextmanager
def restore_torch_set_num_threads():
    """Restore ``torch.set_num_threads`` (and the thread count) after the block."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = _ORIGINAL_SET_NUM_THREADS
        torch.set_num_threads(threads)


@contextlib.contextmanager
def apply_patches():
    """All of kvrl's patches, for the duration of building an engine."""
    with restore_torch_set_num_threads():
        yield


__all__ = ["apply_patches", "restore_torch_set_num_threads"]
