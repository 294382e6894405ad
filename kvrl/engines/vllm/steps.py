"""The per-step plan types of kvrl's vLLM worker: what the builder decides once per forward.

:class:`ReqState` is one request's kvrl state on a worker, kept across its forwards.
Each forward, the builder (``WorkerContext.plan_step``) makes a :class:`StepPlan`, one
:class:`RowPlan` per scheduled request, which every layer's KV write and attention then
read: the evicting regime adds an :class:`EvictBatch` (the requests that evict after the
forward, with an :class:`EvictLayer` per layer waiting for its eviction), the sink + recent
patterns and mixed gates a :class:`WindowPlan`. Plain data: no vLLM, no policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvrl.engines.vllm.layout import HeadPool, PagedLayout


@dataclass
class ReqState:
    """One request's kvrl state on a worker."""

    tag: str
    index: int
    prompt_len: int
    length: int  # prompt + max_tokens + 1: the trace's T
    # [L, H, T] int32 (NEVER = not evicted): the pattern itself in static mode; in token mode
    # the request's row of WorkerContext.deaths while it runs, copied out when it finishes.
    death: Tensor | None
    lens: Tensor | None  # static mode: [L, H] int64 cache entries per head after the last forward
    clen: int = 0  # token mode: cache entries per head (the same for all) after the last forward
    done: int = 0  # true length after the last planned forward
    qslot: int = -1
    generator: torch.Generator | None = None
    pooled: bool = False  # static mode: the request id carries a HeadPool cap (its heads share its blocks)
    events: dict = field(default_factory=dict)  # generated count -> [L, H] sampled-eviction logprobs
    evict_seconds: float = 0.0


@dataclass
class RowPlan:
    req: ReqState
    start: int  # first token of the row in the batch
    q: int  # tokens of the row in this forward
    done: int  # true length before the forward
    blocks: Tensor  # the row's block table (physical ids), on the cache's device
    lens: Tensor | None = None  # static mode: [L, H] cache entries before the forward

    @property
    def m(self) -> int:
        return self.done + self.q


@dataclass
class EvictBatch:
    """Token mode: the requests whose forward ends with an eviction, planned once per step
    and evicted together at every layer, ``per_call`` layers at a time
    (:meth:`WorkerContext._evict`)."""

    rows: list[RowPlan]
    n: int  # slots to read: the longest cache among them (the others are padded)
    blocks: Tensor  # [R, ceil(n / bs)] their block tables
    pad: Tensor  # [R, 1, n] bool: slots beyond the request's cache (position −1 for the policy)
    qslot: Tensor  # [R] ring slots
    qslot_host: Tensor  # [R] the same, for the death table on the host
    m: Tensor  # [R] int32 true length after the forward = the death time of what is evicted
    generators: list | None  # sampling: each request's own generator
    events: Tensor | None  # sampling: [R, L, H] logprobs; row r is a view in rows[r].req.events
    per_call: int = 1  # layers evicted per call (WorkerContext.attention)
    layers: list[EvictLayer] = field(default_factory=list)  # attended, eviction not yet run
    attended: int = 0


@dataclass
class EvictLayer:
    """One layer's part of an :class:`EvictBatch`: what its eviction needs once deferred."""

    index: int
    name: str
    layout: PagedLayout
    kv_cache: Tensor
    scale: float


@dataclass
class StepPlan:
    """What the builder decided for one forward, read by every layer."""

    mode: str
    rows: list[RowPlan]
    positions: Tensor  # [T] true positions of the forward's tokens (cache device)
    q_tok: Tensor  # queries to keep: token indices, and their rows of the flattened ring [slots·W]
    q_flat: Tensor
    # token mode: flat indices into a side store's pos [nb·H·bs] of every (new token, head),
    # and their positions (int32) — the same for every layer of the forward
    side_addr: tuple | None = None
    evict: EvictBatch | None = None  # token mode: the requests that evict after this forward
    window: WindowPlan | None = None  # static mode with a sink + recent pattern


@dataclass
class WindowPlan:
    """Static mode with a sink + recent pattern (:func:`window_heads`), planned once per step.

    Every head stays in vLLM's own layout (slot = position, the stock write); a windowed
    head also keeps its window in its first ``sink + recent`` slots, as a ring (position
    p ≥ sink + recent at slot ``sink + (p − sink) % recent``), which overwrites only keys no
    later query sees. A one-token row's query then reads m slots of a full head and
    ``min(m, sink + recent)`` of a windowed one, all rows and heads in one
    :meth:`PagedLayout.head_attention`; rows of several tokens (prefill chunks) attend
    with the pattern's mask over the stock layout (torch, once per prompt)."""

    decode: Tensor  # [Rd] token index of each one-token row's query (cache device)
    all_decode: bool  # every row is a one-token row (decode index = token index)
    m: Tensor  # [Rd] true length after the forward
    blocks: Tensor  # [Rd, nb] their block tables
    ring: Tensor  # [Rd] ring slot of the row's new token, −1 while it is its own slot
    multi: list[RowPlan]  # rows of several tokens
    # pooled heads (HeadPool): region ids of every row's heads, made at the step's first layer
    pool: HeadPool | None = None
    decode_rows: Tensor | None = None  # [Rd] row index of each one-token row
    multi_rows: list[int] = field(default_factory=list)  # row index of each row in `multi`
    all_blocks: Tensor | None = None  # [R, width] every row's block table
    nblk: int = 0
    table: Tensor | None = None  # [R, L, H, nblk] region ids of each head's logical blocks
    decode_table: Tensor | None = None  # [Rd, L, H, nblk] the one-token rows' rows of it
    write_at: tuple[Tensor, Tensor] | None = None  # one-token rows' (region, offset) [Rd, L, H] of the new key

    def put(self, output: Tensor, out: Tensor) -> None:
        """The one-token rows' attention [Rd, Hq, D] into the forward's output [T, Hq, D]."""
        if self.all_decode:
            output[:out.shape[0]] = out.to(output.dtype)
        else:
            output.index_copy_(0, self.decode, out.to(output.dtype))


__all__ = ["EvictBatch", "EvictLayer", "ReqState", "RowPlan", "StepPlan", "WindowPlan"]
