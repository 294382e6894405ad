"""A registered KV-cache spec and manager that cap each request's blocks at what its policy keeps.

Under a token policy a request's packed cache never holds more than
``max(P, budget + interval)`` entries per head (P = prompt length: the prefill is written
whole, then cut to the budget; afterwards the cache oscillates between ``budget`` and
``budget + interval``; :func:`kvrl.engines.vllm.evicting.cache_len_after`; in ratio mode
the budget is that of the request's longest length, ``budget_at(P + max_tokens)``). vLLM's
scheduler, which knows nothing of that, would keep allocating a block every ``block_size``
tokens. :class:`KVRLManager` (a ``FullAttentionManager``):

* caps the tokens a request needs slots for at ``max(P, keep)``, so its block count stops
  growing — more long requests fit in the same KV memory;
* frees the tail blocks beyond ``keep`` once the prefill of a prompt longer than ``keep``
  has been computed (and so packed): the worker never writes past logical slot ``keep``
  again, and its append-only block table only holds stale ids there.

Under RLKV's head reallocation (a sink + recent pattern on the CPU backend) a request's KV
heads share its blocks' (layer, head) regions (:class:`kvrl.engines.vllm.layout.HeadPool`):
the windowed heads' rings first, then every full head's blocks, so the request needs
:func:`pooled_blocks` blocks at true length m instead of one per ``block_size`` tokens.

The scheduler side only sees request ids, so the engine encodes the cap in the external
request id: ``kvrl.<tag>.p<P>.k<keep>`` or ``kvrl.<tag>.r<rings>.f<full>.n<regions per
block>`` (vLLM appends ``-<8 random chars>``). Requests without either — every request of a
stock engine and kvrl requests under full attention or mixed gates — get the unmodified
full-attention behaviour.

The backend returns :class:`KVRLSpec` from ``customize_spec`` (vLLM's hook for a backend
to adjust a layer's spec), and the plugin registers the pair with
``KVCacheSpecRegistry`` under ``uniform_type_base_spec=FullAttentionSpec``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, fields

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

_CAP = re.compile(r"^kvrl\.[^.]+\.p(\d+)\.k(\d+)")
_POOL = re.compile(r"^kvrl\.[^.]+\.r(\d+)\.f(\d+)\.n(\d+)")


def request_id(tag: str, prompt_len: int, keep: int | None, pool: tuple[int, int, int] | None = None) -> str:
    """External request id carrying the block cap: ``keep`` (token policies) or ``pool``
    (rings, full, regions per block) of :func:`pooled_blocks`; neither: no cap."""
    if pool is not None:
        return f"kvrl.{tag}.r{pool[0]}.f{pool[1]}.n{pool[2]}"
    return f"kvrl.{tag}" if keep is None else f"kvrl.{tag}.p{prompt_len}.k{keep}"


def pooled_blocks(m: int, block_size: int, rings: int, full: int, per_block: int) -> int:
    """Blocks of a request of true length ``m`` whose heads share its blocks' regions:
    ``rings`` regions of windowed heads' rings, then ``full`` heads of ⌈m / bs⌉ regions each,
    ``per_block`` = layers × KV heads regions per block."""
    return cdiv(rings + full * cdiv(m, block_size), per_block)


@functools.lru_cache(maxsize=4096)
def parse_pool(request_id: str) -> tuple[int, int, int] | None:
    """(rings, full, regions per block) from a kvrl request id, or None."""
    m = _POOL.match(request_id)
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3)))


@functools.lru_cache(maxsize=4096)  # the scheduler asks for every running request at every step
def parse_cap(request_id: str) -> tuple[int, int] | None:
    """(prompt length, keep) from a kvrl request id, or None."""
    m = _CAP.match(request_id)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


@dataclass(frozen=True, kw_only=True)
class KVRLSpec(FullAttentionSpec):
    """Full attention whose requests may be capped by :class:`KVRLManager`."""

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec) -> KVRLSpec:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec) if f.init})


class KVRLManager(FullAttentionManager):
    """Full-attention block management with per-request caps from the request id."""

    def _capped(self, request_id: str, num_tokens: int) -> int:
        """The tokens whose blocks the request needs (a block count times the block size)."""
        pool = parse_pool(request_id)
        if pool is not None:
            return self.block_size * pooled_blocks(num_tokens, self.block_size, *pool)
        cap = parse_cap(request_id)
        return num_tokens if cap is None else min(num_tokens, max(cap))

    def get_num_blocks_to_allocate(
        self,
        request_id,
        num_tokens,
        new_computed_blocks,
        total_computed_tokens,
        num_local_computed_tokens,
        num_tokens_main_model,
        *args,
        **kwargs,
    ):
        return super().get_num_blocks_to_allocate(
            request_id,
            self._capped(request_id, num_tokens),
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            self._capped(request_id, num_tokens_main_model),
            *args,
            **kwargs,
        )

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return super().allocate_new_blocks(
            request_id, self._capped(request_id, num_tokens), self._capped(request_id, num_tokens_main_model)
        )

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        cap = parse_cap(request_id)
        if cap is not None:
            prompt_len, keep = cap
            if prompt_len > keep and processed_computed_tokens >= prompt_len:
                blocks = self.req_to_blocks.get(request_id)
                if blocks:
                    self._remove_blocks_in_range(request_id, cdiv(keep, self.block_size), len(blocks))
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)


_registered = False


def register() -> None:
    """Register the spec/manager pair (idempotent; built-ins first, so they stay)."""
    global _registered
    if _registered:
        return
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KVRLSpec, KVRLManager, uniform_type_base_spec=FullAttentionSpec)
    _registered = True
