"""Kernels: torch reference ops (the specification) and native versions tested against them.

``kvrl.kernels.scores``: attention/redundancy scores and the compaction gather used by the
KV policies. ``kvrl.kernels.cpu_cache``: reading and compacting vLLM's CPU paged cache.
``kvrl.kernels.native``: the C++ ops behind both on a CPU (``*.cpp`` here, built on first
use). ``kvrl.kernels.replay``: attention under an eviction trace; it registers a
transformers attention function on import, so it is not imported here.
"""

import torch

NEVER = torch.iinfo(torch.int32).max  # the death time of a key that is never evicted

from kvrl.kernels.scores import gather_slots, key_redundancy, pool_slots, window_attention  # noqa: E402

__all__ = ["NEVER", "gather_slots", "key_redundancy", "pool_slots", "window_attention"]
