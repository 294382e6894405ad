"""Kernels: kvrl's tensor ops, their torch specification and the accelerated versions.

* :mod:`kvrl.kernels.reference` — **the specification**, in torch; it runs everywhere, and
  every other implementation has its signature and is tested against it: the policies'
  scores and key redundancy (``scores.py``), reading and compacting vLLM's paged caches
  (``paged.py``), attention under an eviction trace (``replay.py``), RLKV's mixed-gate
  attention (``mixed.py``) and chunked LM-head logprobs (``logprobs.py``). ``replay`` and
  ``mixed`` register transformers attention functions on import, so nothing here imports
  them.
* :mod:`kvrl.kernels.cpu` — **the CPU accelerator**, optional: C++ ops (``*.cpp``) that
  ``native.py`` builds on first use, and thin wrappers with the reference's signatures
  (``scores.py``, ``paged.py``).
* :mod:`kvrl.kernels.cuda` — **the GPU kernels**, in Triton (``paged.py``: the
  FlashAttention cache's compaction); Triton is imported at the first call.
* :mod:`kvrl.kernels.dispatch` — one table per op, ``{"cpu" | "cuda" | "reference":
  implementation}``, looked up once per call from where the tensors are.

The names below are what the rest of kvrl calls: the dispatched ops, and the reference ops
that have no other implementation.
"""

from kvrl.kernels.dispatch import (
    attention_received,
    flash_compact,
    key_redundancy,
    key_redundancy_update,
    paged_compact_,
    paged_read,
    pool_slots,
)
from kvrl.kernels.reference import NEVER
from kvrl.kernels.reference.paged import flash_read, flash_write, views
from kvrl.kernels.reference.scores import RETAIN_DIRECTIONS, gather_slots, window_attention

__all__ = [
    "NEVER",
    "RETAIN_DIRECTIONS",
    "attention_received",
    "flash_compact",
    "flash_read",
    "flash_write",
    "gather_slots",
    "key_redundancy",
    "key_redundancy_update",
    "paged_compact_",
    "paged_read",
    "pool_slots",
    "views",
    "window_attention",
]
