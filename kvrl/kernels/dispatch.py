"""Which implementation of an op runs: one table per op, looked up once per call.

A table maps where an op's tensors are to an implementation with the reference's signature:

* ``"cpu"`` — the C++ CPU accelerator (:mod:`kvrl.kernels.cpu`), for CPU tensors outside
  autograd once its library has built (:func:`kvrl.kernels.cpu.native.usable`; a failed
  build warns once, naming the fix);
* ``"cuda"`` — a Triton kernel (:mod:`kvrl.kernels.cuda`), for CUDA tensors;
* ``"reference"`` — the torch specification (:mod:`kvrl.kernels.reference`), wherever no
  other entry applies: on a GPU for an op without a kernel, under autograd, without the
  library.

An op may add its own condition on its inputs (a dtype, a contiguous cache), checked before
the library is loaded. The functions below are the ops the rest of kvrl calls (exported by
:mod:`kvrl.kernels`); their parameters and results are the reference's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvrl.kernels.cpu import native
from kvrl.kernels.cpu import paged as cpu_paged
from kvrl.kernels.cpu import scores as cpu_scores
from kvrl.kernels.cuda import paged as cuda_paged
from kvrl.kernels.reference import paged as ref_paged
from kvrl.kernels.reference import scores as ref_scores


def pick(table: dict[str, Callable], *tensors: Tensor, applies: bool = True) -> Callable:
    """``table``'s implementation for ``tensors`` (the inputs that decide); ``applies``: the
    op's own condition for an accelerated entry."""
    if applies:
        if "cpu" in table and native.usable(*tensors):
            return table["cpu"]
        if "cuda" in table and all(t.is_cuda for t in tensors):
            return table["cuda"]
    return table["reference"]


ATTENTION_RECEIVED = {"cpu": cpu_scores.attention_received, "reference": ref_scores.attention_received}
POOL_SLOTS = {"cpu": cpu_scores.pool_slots, "reference": ref_scores.pool_slots}
KEY_REDUNDANCY = {"cpu": cpu_scores.key_redundancy, "reference": ref_scores.key_redundancy}
KEY_REDUNDANCY_UPDATE = {"cpu": cpu_scores.key_redundancy_update, "reference": ref_scores.key_redundancy_update}
PAGED_READ = {"cpu": cpu_paged.paged_read, "reference": ref_paged.paged_read}
PAGED_COMPACT = {"cpu": cpu_paged.paged_compact_, "reference": ref_paged.paged_compact_}
FLASH_COMPACT = {"cuda": cuda_paged.flash_compact, "reference": ref_paged.flash_compact}


def attention_received(queries: Tensor, keys: Tensor, *args, **options) -> Tensor:
    """:func:`kvrl.kernels.reference.scores.attention_received`."""
    return pick(ATTENTION_RECEIVED, queries, keys)(queries, keys, *args, **options)


def pool_slots(x: Tensor, valid: Tensor, kernel_size: int, mode: str) -> Tensor:
    """:func:`kvrl.kernels.reference.scores.pool_slots` (the C++ op takes float32)."""
    return pick(POOL_SLOTS, x, applies=x.dtype == torch.float32)(x, valid, kernel_size, mode)


def key_redundancy(keys: Tensor, valid: Tensor, *args, **options) -> Tensor:
    """:func:`kvrl.kernels.reference.scores.key_redundancy`."""
    return pick(KEY_REDUNDANCY, keys)(keys, valid, *args, **options)


def key_redundancy_update(
    keys: Tensor, key_pos: Tensor, previous_pick: Tensor, *args, **options
) -> tuple[Tensor, Tensor]:
    """:func:`kvrl.kernels.reference.scores.key_redundancy_update`."""
    return pick(KEY_REDUNDANCY_UPDATE, keys)(keys, key_pos, previous_pick, *args, **options)


def paged_read(kv_cache: Tensor, blocks: Tensor, n: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
    """:func:`kvrl.kernels.reference.paged.paged_read` (the C++ op takes a contiguous cache)."""
    return pick(PAGED_READ, kv_cache, applies=kv_cache.is_contiguous())(kv_cache, blocks, n, values)


def paged_compact_(kv_cache: Tensor, blocks: Tensor, keep: Tensor, counts: Tensor | None) -> None:
    """:func:`kvrl.kernels.reference.paged.paged_compact_` (the C++ op takes a contiguous cache)."""
    pick(PAGED_COMPACT, kv_cache, applies=kv_cache.is_contiguous())(kv_cache, blocks, keep, counts)


def flash_compact(kv_cache: Tensor, block_table: Tensor, keep: Tensor, counts: Tensor) -> None:
    """:func:`kvrl.kernels.reference.paged.flash_compact`."""
    pick(FLASH_COMPACT, kv_cache)(kv_cache, block_table, keep, counts)
