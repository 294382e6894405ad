"""The per-step plan types of kvrl's vLLM worker, and what a regime worker answers.

:class:`ReqState` is one request's kvrl state on a worker, kept across its forwards. Each
forward, ``WorkerContext.plan_step`` reads vLLM's metadata into a :class:`StepInput` and a
:class:`StepPlan` (one :class:`RowPlan` per scheduled request), which the installed
:class:`RegimeWorker` completes: the evicting regime with an :class:`EvictBatch` (the
requests that evict after the forward, an :class:`EvictLayer` per layer waiting for its
eviction), the sink + recent patterns and mixed gates with a :class:`WindowPlan`. Every
layer's KV write and attention then call the regime's hooks with a :class:`LayerCall` (the
plan, the layer, its tensors). Plain data and an interface: no vLLM, no policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
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
    # [L, H, T] int32 (NEVER = not evicted): the pattern itself in the static regime; in the
    # evicting regime the request's row of its death table while it runs, copied out when it finishes.
    death: Tensor | None = None
    lens: Tensor | None = None  # static: [L, H] int64 cache entries per head after the last forward
    clen: int = 0  # evicting: cache entries per head (the same for all) after the last forward
    done: int = 0  # true length after the last planned forward
    qslot: int = -1
    generator: torch.Generator | None = None
    pooled: bool = False  # static: the request id carries a HeadPool cap (its heads share its blocks)
    events: dict = field(default_factory=dict)  # generated count -> [L, H] sampled-eviction logprobs
    evict_seconds: float = 0.0


@dataclass
class RowPlan:
    req: ReqState
    start: int  # first token of the row in the batch
    q: int  # tokens of the row in this forward
    done: int  # true length before the forward
    blocks: Tensor | None  # the row's block table (physical ids), on the cache's device
    lens: Tensor | None = None  # static: [L, H] cache entries before the forward

    @property
    def m(self) -> int:
        return self.done + self.q


@dataclass
class EvictBatch:
    """Evicting regime: the requests whose forward ends with an eviction, planned once per
    step and evicted together at every layer, ``per_call`` layers at a time
    (:meth:`kvrl.engines.vllm.evicting.EvictingWorker._evict`)."""

    rows: list[RowPlan]
    n: int  # slots to read: the longest cache among them (the others are padded)
    blocks: Tensor  # [R, ceil(n / bs)] their block tables
    pad: Tensor  # [R, 1, n] bool: slots beyond the request's cache (position −1 for the policy)
    qslot: Tensor  # [R] ring slots
    qslot_host: Tensor  # [R] the same, for the death table on the host
    m: Tensor  # [R] int32 true length after the forward = the death time of what is evicted
    generators: list | None  # sampling: each request's own generator
    events: Tensor | None  # sampling: [R, L, H] logprobs; row r is a view in rows[r].req.events
    per_call: int = 1  # layers evicted per call (EvictingWorker.attention)
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

    rows: list[RowPlan]
    positions: Tensor  # [T] true positions of the forward's tokens (cache device)
    q_tok: Tensor  # queries to keep: token indices, and their rows of the flattened ring [slots·W]
    q_flat: Tensor
    # evicting: flat indices into a side store's pos [nb·H·bs] of every (new token, head),
    # and their positions (int32) — the same for every layer of the forward
    side_addr: tuple | None = None
    evict: EvictBatch | None = None  # evicting: the requests that evict after this forward
    # evicting: each row's packed cache length after the forward, the kernel's seq_lens
    # (the builder rewrites vLLM's metadata with them); None: vLLM's own lengths
    kernel_seq_lens: Tensor | None = None
    window: WindowPlan | None = None  # a sink + recent pattern or mixed gates


@dataclass
class StepInput:
    """What the builder read of one forward, for the regime's plan (host arrays unless said)."""

    cm: object  # vLLM's CommonAttentionMetadata (slot_mapping is rewritten in place)
    input_batch: object  # vLLM's InputBatch (its host block table)
    block_size: int
    positions: Tensor  # [T] int64 true positions of the forward's tokens
    counts: np.ndarray  # [R] tokens of each row
    tok_row: np.ndarray  # [T] row of each token
    offs: np.ndarray  # [T] index of each token within its row
    done: np.ndarray  # [R] true length before the forward
    fresh: list[int]  # ring slots of the requests seen for the first time
    slots: int  # ring slots in use


@dataclass
class WindowPlan:
    """A sink + recent pattern (static) or mixed gates, planned once per step.

    Every head stays in vLLM's own layout (slot = position, the stock write); under a static
    pattern a windowed head also keeps its window in its first ``sink + recent`` slots, as a
    ring (position p ≥ sink + recent at slot ``sink + (p − sink) % recent``), which
    overwrites only keys no later query sees. A one-token row's query then reads m slots of
    a full head and ``min(m, sink + recent)`` of a windowed one, all rows and heads in one
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

    @classmethod
    def of(cls, rows: list[RowPlan], bt_dev: Tensor, sink: int, recent: int) -> WindowPlan:
        """The one-token rows and the prompt chunks of a step, and the ring slots of the
        one-token rows' new keys (block tables ``bt_dev`` on the cache's device)."""
        dev = bt_dev.device
        one = [i for i, r in enumerate(rows) if r.q == 1]
        m = np.asarray([rows[i].m for i in one], dtype=np.int64)
        p = m - 1
        ring = np.where(p >= sink + recent, sink + (p - sink) % recent, -1)
        multi = [i for i, r in enumerate(rows) if r.q > 1]
        return cls(
            torch.tensor([rows[i].start for i in one], dtype=torch.long, device=dev),
            len(one) == len(rows),
            torch.from_numpy(m).to(dev),
            bt_dev[one],
            torch.from_numpy(ring).to(dev),
            [rows[i] for i in multi],
            multi_rows=multi,
        )

    def put(self, output: Tensor, out: Tensor) -> None:
        """The one-token rows' attention [Rd, Hq, D] into the forward's output [T, Hq, D]."""
        if self.all_decode:
            output[: out.shape[0]] = out.to(output.dtype)
        else:
            output.index_copy_(0, self.decode, out.to(output.dtype))


@dataclass
class LayerCall:
    """One attention layer's call into the installed regime, what every regime's hook reads:
    :mod:`.shim` makes one for the layer's KV write (:meth:`RegimeWorker.kv_update`) and one
    for its attention (:meth:`RegimeWorker.attention`) in every planned forward."""

    plan: StepPlan
    index: int  # the layer's index in the model
    name: str  # vLLM's layer name (the side stores are kept by it)
    layout: PagedLayout  # how the layer's cache stores K and V
    kv_cache: Tensor
    key: Tensor | None  # [T, H, D] the forward's new keys and values
    value: Tensor | None
    stock: Callable[[], object]  # vLLM's own KV write (kv_update) or attention (attention)
    slot_mapping: Tensor | None = None  # kv_update: vLLM's cache slot of each new token
    query: Tensor | None = None  # attention: [T, Hq, D]
    output: Tensor | None = None  # attention: [T, Hq, D], written in place
    scale: float = 1.0  # attention: the softmax scale


class RegimeWorker:
    """The installed cache regime's part of a worker; ``WorkerContext`` keeps the requests,
    the side stores and the query ring, and delegates to one of these (one module per regime:
    :mod:`.full`, :mod:`.evicting`, :mod:`.static`, :mod:`.mixed`). What a regime needs of
    the shared state is handed to it when it is installed."""

    plans = True  # False: the builder plans nothing and vLLM runs untouched
    row_blocks = True  # rows carry a view of their block table (the evicting regime reads it whole)
    pools = False  # requests may pool their heads' blocks (HeadPool)
    state_size = 0  # per-token policy state each side-store slot holds

    def admit(self, req: ReqState) -> None:
        """A request seen for the first time: its regime's part (a pattern row, a death-table row)."""

    def release(self, req: ReqState) -> None:
        """A finished request: keep in ``req`` what its trace needs."""

    def plan(self, plan: StepPlan, step: StepInput) -> None:
        """Complete ``plan`` before the stock metadata build."""

    def kv_update(self, call: LayerCall) -> None:
        """Write the forward's new keys/values (and their positions/state) to the layer's
        cache; by default vLLM's own write (slot = position)."""
        call.stock()

    def attention(self, call: LayerCall) -> None:
        """Attention of the forward into ``call.output`` [T, Hq, D], then whatever the layer's
        cache needs after it."""
        raise NotImplementedError


__all__ = [
    "EvictBatch",
    "EvictLayer",
    "LayerCall",
    "RegimeWorker",
    "ReqState",
    "RowPlan",
    "StepInput",
    "StepPlan",
    "WindowPlan",
]
