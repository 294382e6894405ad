"""Reading and compacting vLLM's CPU paged cache on the C++ CPU ops (``paged.cpp``).

The signatures and results of :mod:`kvrl.kernels.reference.paged`'s CPU-layout ops, bit for
bit (pure data movement), at the CPU's memory bandwidth; :mod:`kvrl.kernels.dispatch` runs
them on contiguous caches once the library has built.
"""

from __future__ import annotations

from torch import Tensor

from kvrl.kernels.cpu import native


def paged_read(kv_cache: Tensor, blocks: Tensor, n: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
    """:func:`~kvrl.kernels.reference.paged.paged_read`."""
    k_t, v = native.ops().paged_read(kv_cache, blocks.long(), n, values)
    return k_t[..., :n].transpose(-1, -2), v[:, :, :n] if values else None


def paged_compact_(kv_cache: Tensor, blocks: Tensor, keep: Tensor, counts: Tensor | None) -> None:
    """:func:`~kvrl.kernels.reference.paged.paged_compact_`."""
    native.ops().paged_compact_(
        kv_cache, blocks.long(), keep.long().contiguous(), None if counts is None else counts.long().contiguous()
    )
