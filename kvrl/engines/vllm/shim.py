"""The overrides of vLLM's attention classes that kvrl's CPU and CUDA backends share (mixins).

Each backend (:mod:`.cpu_backend`, :mod:`.cuda_backend`) subclasses vLLM's stock metadata
builder, implementation and backend with these mixins first in the bases, and adds only
what depends on its cache layout: ``LAYOUT`` (a :class:`kvrl.engines.vllm.layout.PagedLayout`)
and, where a layout must be checked against the stock write op, :meth:`KVRLImplMixin._check_layout`.
Without an installed kvrl regime every method defers to the stock class unchanged; with one,
they call the hooks of the worker context (:mod:`kvrl.engines.vllm.runtime`), which hands
them to the installed regime.
"""

from __future__ import annotations

import functools

from vllm.forward_context import get_forward_context
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvrl.engines.vllm.kv_manager import KVRLSpec
from kvrl.engines.vllm.layout import PagedLayout
from kvrl.engines.vllm.runtime import context, layer_index
from kvrl.engines.vllm.steps import LayerCall


class KVRLBuilderMixin:
    """Plans each forward (``runtime.WorkerContext.plan_step``) before the stock build. Under
    an evicting regime the kernel sees each request's packed cache length: ``seq_lens`` (and its
    host upper bound, where the metadata has one) are rewritten, and cascade attention is
    off (it assumes shared, unpacked prefixes)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        ctx = context(self.vllm_config)  # this engine's: a process may hold two (inline workers)
        plan = ctx.plan_step(cm, self.kv_cache_spec.block_size)
        if plan is not None and plan.kernel_seq_lens is not None:
            n = plan.kernel_seq_lens.shape[0]
            seq_lens = cm.seq_lens.clone()
            seq_lens[:n], seq_lens[n:] = plan.kernel_seq_lens, 0
            upper = plan.kernel_seq_lens.cpu()
            extra = {}
            if getattr(cm, "seq_lens_cpu_upper_bound", None) is not None:
                bound = cm.seq_lens_cpu_upper_bound.clone()
                bound[:n], bound[n:] = upper, 0
                extra["seq_lens_cpu_upper_bound"] = bound
            cm = cm.replace(seq_lens=seq_lens, max_seq_len=int(upper.max()), **extra)
            common_prefix_len = 0
        meta = super().build(common_prefix_len, cm, fast_build)
        meta.kvrl_plan, meta.kvrl_context = plan, ctx
        return meta


class KVRLImplMixin:
    """Stock attention plus kvrl's writes, attention modes and evictions."""

    LAYOUT: PagedLayout
    _layer_idx: int | None = None

    def _index(self, layer) -> int:
        if self._layer_idx is None:
            self._layer_idx = layer_index(layer.layer_name)
        return self._layer_idx

    def _check_layout(self, layer, kv_cache) -> None:
        """Raise if kvrl cannot address this cache's K/V (default: nothing to check)."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        meta = get_forward_context().attn_metadata
        meta = meta.get(layer.layer_name) if isinstance(meta, dict) else meta
        plan = getattr(meta, "kvrl_plan", None)
        stock = functools.partial(super().do_kv_cache_update, layer, key, value, kv_cache, slot_mapping)
        if plan is None:
            return stock()
        self._check_layout(layer, kv_cache)
        call = LayerCall(
            plan, self._index(layer), layer.layer_name, self.LAYOUT, kv_cache, key, value, stock, slot_mapping
        )
        meta.kvrl_context.kv_update(call)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        plan = getattr(attn_metadata, "kvrl_plan", None)
        stock = functools.partial(
            super().forward, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        if plan is None:
            return stock()
        n = attn_metadata.num_actual_tokens
        call = LayerCall(
            plan,
            self._index(layer),
            layer.layer_name,
            self.LAYOUT,
            kv_cache,
            None if key is None else key[:n],
            None if value is None else value[:n],
            stock,
            query=query[:n],
            output=output[:n],
            scale=self.scale,
        )
        attn_metadata.kvrl_context.attention(call)
        return output


class KVRLBackendMixin:
    """The stock backend with :class:`KVRLSpec` (block caps per request,
    :mod:`kvrl.engines.vllm.kv_manager`) for full-attention layers."""

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        return KVRLSpec.from_spec(spec) if type(spec) is FullAttentionSpec else spec
