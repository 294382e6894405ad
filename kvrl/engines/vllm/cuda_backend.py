"""kvrl's CUDA attention backend: FlashAttention plus the layout-specific packing op.

Only what depends on the FlashAttention cache layout lives here; metadata remapping, the
eviction schedule, policy state and traces are the CPU path's (:mod:`.runtime` and the
regime modules, :mod:`.evicting`, :mod:`.static`, :mod:`.mixed`).

FlashAttention cache layout (vllm 0.32 ``v1/attention/backends/flash_attn.py``): each
layer's cache is the logical tensor ``[num_blocks, H, block_size, 2·D]``, read as
``kv_cache.transpose(1, 2).split(D, -1)``: K is channels ``[:D]`` and V channels ``[D:]``
of (block, head, offset). The physical order follows vLLM's KV-cache layout (LBNHC by
default: offset outside head; ``VLLM_KV_CACHE_LAYOUT`` can select LBHNC), so every op
here addresses elements through the tensor's strides and works for either.

Ops (each with a torch reference of the same signature, the specification):

* :func:`flash_compact` / :func:`flash_compact_ref` — in-place per-(request, head)
  compaction ``slot j ← slot keep[r, h, j]`` for ``j < counts[r]`` (keep ascending, so
  ``keep[j] ≥ j``): one Triton program per (request, head) moves the kept tokens in
  ascending order, which never reads a slot it has already overwritten.
* :func:`flash_read` / :func:`flash_write` — gather/scatter of a request's logical slots
  (torch advanced indexing; on CUDA these are single gather/scatter kernels already).

The vLLM classes (:class:`KVRLFlashBackend`, registered as ``AttentionBackendEnum.CUSTOM``
by the plugin) are built on first access, so this module imports without vLLM — the ops
are tested on GPU machines that cannot install vLLM's CUDA build.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from kvrl.engines.vllm.layout import PagedLayout


def flash_read(kv_cache: Tensor, blocks: Tensor, n: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
    """K, V [R, H, n, D] of logical slots 0..n−1 (request r's slot j in block ``blocks[r, j // bs]``;
    V None unless ``values``)."""
    bs, d2 = kv_cache.shape[2], kv_cache.shape[3]
    j = torch.arange(n, device=kv_cache.device)
    blk = blocks.to(kv_cache.device)[:, j // bs].long()  # [R, n]
    x = (kv_cache if values else kv_cache[..., :d2 // 2])[blk, :, j % bs]  # [R, n, H, 2D or D]
    return x[..., :d2 // 2].transpose(1, 2), x[..., d2 // 2:].transpose(1, 2) if values else None


def flash_write(kv_cache: Tensor, blocks: Tensor, rows: Tensor, heads: Tensor, slots: Tensor, keys: Tensor,
                values: Tensor) -> None:
    """Store keys/values [M, D] at (request ``rows[i]``, head ``heads[i]``, logical slot ``slots[i]``)."""
    bs, d2 = kv_cache.shape[2], kv_cache.shape[3]
    blk, off = blocks.to(kv_cache.device)[rows, slots // bs].long(), slots % bs
    kv_cache[blk, heads, off, :d2 // 2] = keys.to(kv_cache.dtype)
    kv_cache[blk, heads, off, d2 // 2:] = values.to(kv_cache.dtype)


def flash_compact_ref(kv_cache: Tensor, block_table: Tensor, keep: Tensor, counts: Tensor) -> None:
    """Torch reference of :func:`flash_compact`.

    Parameters
    ----------
    kv_cache : Tensor [num_blocks, H, bs, 2·D] (any strides)
    block_table : Tensor [R, max_blocks] int — physical block of each request's logical block
    keep : Tensor [R, H, K] int64 — kept slots per head, ascending in ``[:counts[r]]``
    counts : Tensor [R] int — kept slots of each request (the rest of ``keep`` is ignored)
    """
    bs = kv_cache.shape[2]
    for r in range(keep.shape[0]):
        k = int(counts[r])
        if k == 0:
            continue
        src = keep[r, :, :k]  # [H, k]
        h = torch.arange(keep.shape[1], device=kv_cache.device)[:, None].expand(-1, k)
        bt = block_table[r].long()
        moved = kv_cache[bt[src // bs], h, src % bs].clone()  # [H, k, 2D]
        dst = torch.arange(k, device=kv_cache.device)[None, :].expand_as(src)
        kv_cache[bt[dst // bs], h, dst % bs] = moved


@functools.lru_cache(maxsize=2)
def _compact_kernel(interpret: bool):
    """The Triton kernel, built on first use (``TRITON_INTERPRET=1`` runs it on CPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(kv_ptr, bt_ptr, keep_ptr, counts_ptr, s_blk, s_head, s_tok, s_ch, bt_stride, keep_sr, keep_sh,
               block_size, D2: tl.constexpr, BLOCK_C: tl.constexpr):
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
    """In-place per-(request, head) compaction on the FlashAttention layout (Triton);
    same signature and result as :func:`flash_compact_ref`."""
    import triton

    r, h, _ = keep.shape
    keep = keep.contiguous().long()
    block_table = block_table.contiguous()
    d2 = kv_cache.shape[3]
    kernel = _compact_kernel(os.environ.get("TRITON_INTERPRET", "0") == "1")
    s = kv_cache.stride()
    kernel[(r, h)](kv_cache, block_table, keep, counts.to(torch.int32).contiguous(), s[0], s[1], s[2], s[3],
                   block_table.stride(0), keep.stride(0), keep.stride(1), kv_cache.shape[2], D2=d2,
                   BLOCK_C=triton.next_power_of_2(d2))


class FlashLayout(PagedLayout):
    """:class:`PagedLayout` of the FlashAttention cache."""

    def read(self, kv_cache, blocks, n, values=True):
        return flash_read(kv_cache, blocks, n, values)

    def write(self, kv_cache, blocks, rows, heads, slots, keys, values):
        flash_write(kv_cache, blocks, rows, heads, slots, keys, values)

    def compact(self, kv_cache, blocks, keep, counts):
        if counts is None:
            counts = torch.full((keep.shape[0],), keep.shape[2])
        op = flash_compact if kv_cache.is_cuda else flash_compact_ref
        op(kv_cache, blocks, keep, counts.to(kv_cache.device))


LAYOUT = FlashLayout()


@functools.lru_cache(maxsize=1)
def _backend_classes():
    """Subclasses of vLLM's FlashAttention backend running kvrl's hooks (needs vLLM CUDA);
    the overrides are the mixins of :mod:`kvrl.engines.vllm.shim`, shared with the CPU backend."""
    from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                       FlashAttentionMetadataBuilder)

    from kvrl.engines.vllm.shim import KVRLBackendMixin, KVRLBuilderMixin, KVRLImplMixin

    class KVRLFlashMetadataBuilder(KVRLBuilderMixin, FlashAttentionMetadataBuilder):
        pass

    class KVRLFlashImpl(KVRLImplMixin, FlashAttentionImpl):
        LAYOUT = LAYOUT

    class KVRLFlashBackend(KVRLBackendMixin, FlashAttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return KVRLFlashImpl

        @staticmethod
        def get_builder_cls():
            return KVRLFlashMetadataBuilder

    classes = {"KVRLFlashBackend": KVRLFlashBackend, "KVRLFlashImpl": KVRLFlashImpl,
               "KVRLFlashMetadataBuilder": KVRLFlashMetadataBuilder}
    for name, cls in classes.items():  # importable by qualified name (vLLM resolves and pickles them so)
        cls.__qualname__ = name
    return classes


def __getattr__(name):
    if name in ("KVRLFlashBackend", "KVRLFlashImpl", "KVRLFlashMetadataBuilder"):
        return _backend_classes()[name]
    raise AttributeError(name)
