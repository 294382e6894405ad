"""kvrl's CUDA attention backend: vLLM's FlashAttention backend running kvrl's hooks.

Only what depends on the FlashAttention cache layout lives here; metadata remapping, the
eviction schedule, policy state and traces are the CPU path's (:mod:`.runtime` and the
regime modules, :mod:`.evicting`, :mod:`.static`, :mod:`.mixed`). :class:`FlashLayout`
reads, writes and compacts the cache with the ops of :mod:`kvrl.kernels` (the layout and
its torch specification: :mod:`kvrl.kernels.reference.paged`; the compaction runs the
Triton kernel of :mod:`kvrl.kernels.cuda.paged` on a GPU).

The vLLM classes (:class:`KVRLFlashBackend`, registered as ``AttentionBackendEnum.CUSTOM``
by the plugin) are built on first access, so this module imports without vLLM — the layout
is tested on GPU machines that cannot install vLLM's CUDA build.
"""

from __future__ import annotations

import functools

import torch

from kvrl.engines.vllm.layout import PagedLayout
from kvrl.kernels import flash_compact, flash_read, flash_write


class FlashLayout(PagedLayout):
    """:class:`PagedLayout` of the FlashAttention cache."""

    def read(self, kv_cache, blocks, n, values=True):
        return flash_read(kv_cache, blocks, n, values)

    def write(self, kv_cache, blocks, rows, heads, slots, keys, values):
        flash_write(kv_cache, blocks, rows, heads, slots, keys, values)

    def compact(self, kv_cache, blocks, keep, counts):
        if counts is None:
            counts = torch.full((keep.shape[0],), keep.shape[2])
        flash_compact(kv_cache, blocks, keep, counts.to(kv_cache.device))


LAYOUT = FlashLayout()


@functools.lru_cache(maxsize=1)
def _backend_classes():
    """Subclasses of vLLM's FlashAttention backend running kvrl's hooks (needs vLLM CUDA);
    the overrides are the mixins of :mod:`kvrl.engines.vllm.shim`, shared with the CPU backend."""
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionBackend,
        FlashAttentionImpl,
        FlashAttentionMetadataBuilder,
    )

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

    classes = {
        "KVRLFlashBackend": KVRLFlashBackend,
        "KVRLFlashImpl": KVRLFlashImpl,
        "KVRLFlashMetadataBuilder": KVRLFlashMetadataBuilder,
    }
    for name, cls in classes.items():  # importable by qualified name (vLLM resolves and pickles them so)
        cls.__qualname__ = name
    return classes


def __getattr__(name):
    if name in ("KVRLFlashBackend", "KVRLFlashImpl", "KVRLFlashMetadataBuilder"):
        return _backend_classes()[name]
    raise AttributeError(name)
