"""Compacting vLLM's FlashAttention paged cache on the GPU: a Triton kernel.

:func:`flash_compact` has the signature and the result of
:func:`kvrl.kernels.reference.paged.flash_compact` (layout and parameters there), which the
tests hold it to on CUDA and in Triton's CPU interpreter (``TRITON_INTERPRET=1``);
:mod:`kvrl.kernels.dispatch` runs it on CUDA caches. One Triton program per (request, head)
moves the kept tokens in ascending order, which never reads a slot it has already
overwritten (``keep[j] ≥ j``). Every element is addressed through the cache's strides, so
either physical order of vLLM's layout works.

Triton is imported at the first call: a machine without it (CPU only) imports this module
and runs the reference.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor


@functools.lru_cache(maxsize=2)
def _compact_kernel(interpret: bool):
    """The Triton kernel, built on first use (``TRITON_INTERPRET=1`` runs it on CPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        kv_ptr,
        bt_ptr,
        keep_ptr,
        counts_ptr,
        s_blk,
        s_head,
        s_tok,
        s_ch,
        bt_stride,
        keep_sr,
        keep_sh,
        block_size,
        D2: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        r = tl.program_id(0)
        h = tl.program_id(1)
        count = tl.load(counts_ptr + r)
        c = tl.arange(0, BLOCK_C)
        cmask = c < D2
        for j in range(0, count):
            src = tl.load(keep_ptr + r * keep_sr + h * keep_sh + j)
            if src != j:
                sb = tl.load(bt_ptr + r * bt_stride + src // block_size).to(tl.int64)
                db = tl.load(bt_ptr + r * bt_stride + j // block_size).to(tl.int64)
                sp = kv_ptr + sb * s_blk + h * s_head + (src % block_size) * s_tok + c * s_ch
                dp = kv_ptr + db * s_blk + h * s_head + (j % block_size) * s_tok + c * s_ch
                tl.store(dp, tl.load(sp, mask=cmask), mask=cmask)

    return kernel


def flash_compact(kv_cache: Tensor, block_table: Tensor, keep: Tensor, counts: Tensor) -> None:
    """In-place per-(request, head) compaction on the FlashAttention layout (Triton):
    :func:`kvrl.kernels.reference.paged.flash_compact`."""
    import triton

    r, h, _ = keep.shape
    keep = keep.contiguous().long()
    block_table = block_table.contiguous()
    d2 = kv_cache.shape[3]
    kernel = _compact_kernel(os.environ.get("TRITON_INTERPRET", "0") == "1")
    s = kv_cache.stride()
    kernel[(r, h)](
        kv_cache,
        block_table,
        keep,
        counts.to(torch.int32).contiguous(),
        s[0],
        s[1],
        s[2],
        s[3],
        block_table.stride(0),
        keep.stride(0),
        keep.stride(1),
        kv_cache.shape[2],
        D2=d2,
        BLOCK_C=triton.next_power_of_2(d2),
    )
