"""A registered KV-cache spec and manager that cap each request's blocks at what its policy keeps.

Under a token policy a request's packed cache never holds more than
``max(P, budget + interval)`` entries per head (P = prompt length: the prefill is written
whole, then cut to the budget; afterwards the cache oscillates between ``budget`` and
``budget + interval``; :func:`kvrl.engines.vllm.runtime.cache_len_after`; in ratio mode
the budget is that of the request's longest length, ``budget_at(P + max_tokens)``). vLLM's
scheduler, which knows nothing of that, would keep allocating a block every ``block_size``
tokens. :class:`KVRLManager` (a ``FullAttentionManager``):

* caps the tokens a request needs slots for at ``max(P, keep)``, so its block count stops
  growing — more long requests fit in the same KV memory;
* frees the tail blocks beyond ``keep`` once the prefill of a prompt longer than ``keep``
  has been computed (and so packed): the worker never writes past logical slot ``keep``
  again, and its append-only block table only holds stale ids there.

The scheduler side only sees request ids, so the engine encodes the cap in the external
request id: ``kvrl.<tag>.p<P>.k<keep>`` (vLLM appends ``-<8 random chars>``). Requests
without it — every request of a stock engine and kvrl requests without a token policy —
get the unmodified full-attention behaviour.

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


def request_id(tag: str, prompt_len: int, keep: int | None) -> str:
    """External request id carrying the block cap (``keep`` = None: no cap)."""
    return f"kvrl.{tag}" if keep is None else f"kvrl.{tag}.p{prompt_len}.k{keep}"


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
        cap = parse_cap(request_id)
        return num_tokens if cap is None else min(num_tokens, max(cap))

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, *args, **kwargs):
        return super().get_num_blocks_to_allocate(
            request_id, self._capped(request_id, num_tokens), new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, self._capped(request_id, num_tokens_main_model), *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return super().allocate_new_blocks(request_id, self._capped(request_id, num_tokens),
                                           self._capped(request_id, num_tokens_main_model))

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
