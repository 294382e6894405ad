"""The ``Evicting`` regime on a vLLM worker: a :class:`kvrl.policies.KVPolicy` evicts tokens
as the requests decode (:class:`kvrl.policies.regime.Evicting`).

All heads hold the same number of slots, a deterministic function of the true length and
the prompt length (:func:`cache_len_after`), so the builder rewrites ``seq_lens`` and
``slot_mapping`` and vLLM's own attention kernel runs unchanged. After the attention of
the forward that :func:`kvrl.policies.should_evict` names, the policy scores the cache (the
same policy object as in the HF engine), selects, and the layer is compacted; deaths are
recorded as in :class:`kvrl.cache.KVCache` (the last query position of the forward + 1).

The builder plans each step once (:meth:`EvictingWorker.plan`): the slot remap, the ring
slots of the observation queries, and which requests evict (an
:class:`kvrl.engines.vllm.steps.EvictBatch`). Every layer then evicts all of those requests
together: one read of their caches (shorter ones padded to the longest with position −1,
which policies never keep or count), one :func:`kvrl.policies.evict.evict` over the batch
(sampled draws use each request's own generator, so a draw does not depend on what it was
batched with), one death-table write and one compaction scatter — no Python loop over
requests or heads. When fewer than ``EVICT_ROWS`` requests are due, one call takes several
layers (a layer's eviction waits for the next layers' attention: each layer has its own
cache), unless the policy reads the layer. Non-evicting steps cost one vectorised write
per layer (positions, NaN state, ring queries).

The query ring (:class:`QueryRing`) and the side stores are the worker context's, kept
across regimes; the death table of the running requests is this regime's.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from kvrl.engines.vllm.layout import SideStores
from kvrl.engines.vllm.steps import (
    EvictBatch,
    EvictLayer,
    LayerCall,
    RegimeWorker,
    ReqState,
    RowPlan,
    StepInput,
    StepPlan,
)
from kvrl.kernels import NEVER, gather_slots
from kvrl.policies.base import KVPolicy, Observation, should_evict
from kvrl.policies.evict import evict

# Query-key logits per policy.score call at an eviction (2 MiB of float32): requests are
# scored in groups that fit (see EvictingWorker._evict): groups that stay in a core's L2/L3 are
# scored fastest (`benchmarks/system/vllm_throughput.py calls` at 64 requests, with this constant
# edited, times the group sizes on a given CPU).
SCORE_LOGITS = 1 << 19
# (request, layer) rows an eviction call gathers at least, when the policy ignores the layer:
# with fewer requests due in a step than this, a call takes several layers, which spreads its
# fixed cost (an R-KV score and select are some 150 small torch ops) over more rows; with more,
# a call is one layer. `benchmarks/system/vllm_throughput.py calls` measures both below 16 requests.
EVICT_ROWS = 16


def cache_len_after(m: int, prompt_len: int, policy: KVPolicy) -> int:
    """Cache entries per KV head after the forward that brings the true length to ``m``.

    The HF cache's schedule (:func:`kvrl.policies.should_evict`): after the forward that
    brings the generated count g = m − P to a multiple of ``interval`` (prefill included),
    the cache is cut to b(P + g) = ``policy.budget_at(P + g)`` if it holds more. L − b(L)
    never decreases and b grows by at most ``interval`` per interval (ratio ≤ 1), so once
    cut the cache is cut (or lands exactly on the budget) at every later multiple; with e
    the last multiple ≤ g: ``b(P + e) + (g − e)`` if ``P + e > b(P + e)``, else ``m``.
    Chunked prefill (m < P) never evicts. ``m`` and ``prompt_len`` may be int64 tensors [R].
    """
    g = m - prompt_len
    e = g - g % policy.interval
    kept = policy.budget_at(prompt_len + e)
    if isinstance(m, Tensor):  # [R] lengths and prompt lengths → [R]
        return torch.where((m >= prompt_len) & (prompt_len + e > kept), kept + (g - e), m)
    if m < prompt_len:
        return m
    return kept + (g - e) if prompt_len + e > kept else m


class QueryRing:
    """The last ``observe`` post-RoPE queries of each running request, per layer, kept for the
    process's life (the worker context's: a worker serves many regimes)."""

    def __init__(self):
        self.queries: dict[int, Tensor] = {}  # layer -> [slots, W, Hq, D], ring index = position % W
        # [slots, W] their positions (−1 = none yet), the same for every layer: written once per step
        self.pos: Tensor | None = None

    def positions(self, w: int, slots: int, device) -> Tensor:
        """The ring's positions [slots, W], grown to hold the ``slots`` in use (kept)."""
        old = self.pos
        if old is not None and old.shape[1] != w:  # another policy's window: nothing in it is needed
            old = None
        if old is None or old.shape[0] < slots:
            # doubling only the ring in use: a ring doubled at every change of window grew
            # without bound in a long-lived worker (one process, many policies)
            grown = torch.full(
                (max(slots, 2 * (old.shape[0] if old is not None else 2)), w), -1, dtype=torch.long, device=device
            )
            if old is not None:
                grown[: old.shape[0]] = old
            self.pos = grown
        return self.pos

    def for_layer(self, layer: int, query: Tensor) -> Tensor:
        """This layer's ring of queries [slots, W, Hq, D], as many slots as the positions'."""
        ring = self.queries.get(layer)
        shape = (self.pos.shape[0], self.pos.shape[1], *query.shape[1:])
        if ring is None or ring.shape != shape or ring.dtype != query.dtype:
            grown = query.new_zeros(shape)
            if ring is not None and ring.shape[1:] == shape[1:]:
                grown[: ring.shape[0]] = ring
            ring = self.queries[layer] = grown
        return ring


class EvictingWorker(RegimeWorker):
    """A KV policy evicting as the requests decode (see the module docstring)."""

    row_blocks = False  # the plan reads the block table as a whole (a row view costs 2 µs, 64 of them a step)

    def __init__(self, policy: KVPolicy, sample: bool, geometry: tuple[int, int], sides: SideStores, ring: QueryRing):
        self.policy, self.sample, self.geometry = policy, sample, geometry
        self.sides, self.ring = sides, ring
        self.state_size = policy.state_size
        # death times of the running requests, row = ring slot: [slots, L, H, T] int32 on the
        # host, T ≥ every running request's length (one write per evicting layer)
        self.deaths: Tensor | None = None
        self.deferred: EvictBatch | None = None  # the last step's evictions

    def admit(self, req: ReqState) -> None:
        self._death_rows(req.qslot + 1, req.length)[req.qslot] = NEVER

    def release(self, req: ReqState) -> None:
        req.death = self.deaths[req.qslot, :, :, : req.length].clone()

    def _death_rows(self, slots: int, length: int) -> Tensor:
        """The death table with room for ``slots`` requests of ``length`` tokens (grown, kept)."""
        layers, heads = self.geometry
        old = self.deaths
        if old is None or old.shape[0] < slots or old.shape[-1] < length:
            cap = max(slots, old.shape[0] if old is not None else 0)
            cap = -(-cap // 8) * 8  # grow in steps of 8 requests: few copies
            self.deaths = torch.full(
                (cap, layers, heads, max(length, old.shape[-1] if old is not None else 0)), NEVER, dtype=torch.int32
            )
            if old is not None:
                self.deaths[: old.shape[0], :, :, : old.shape[-1]] = old
        return self.deaths

    def plan(self, plan: StepPlan, step: StepInput) -> None:
        """Which queries the ring keeps, the schedule, the remapped slot mapping and kernel
        lengths, and the rows that evict after this forward's attention."""
        if self.deferred is not None and self.deferred.layers:
            raise RuntimeError(
                f"the last forward's eviction never ran: {self.deferred.attended} of the model's "
                f"{self.geometry[0]} layers attended through kvrl's backend (models with attention layers "
                "outside it are not supported)"
            )
        # queries to keep, at ring index position % W: the last `observe` of each row, and of
        # those only the ones an eviction will read. Evictions follow the forwards that bring
        # the generated count g to a multiple of the interval, so a generated token's query
        # (g = position − prompt + 1) is read iff (−g) mod interval < W; the W tokens before
        # an eviction then overwrite every ring entry. W < interval (SnapKV, R-KV, G-KV)
        # spares the other steps their ring write at every layer.
        cm, block_size, positions, tok_row = step.cm, step.block_size, step.positions, step.tok_row
        counts, done = step.counts, step.done
        policy, rows, dev = self.policy, plan.rows, cm.slot_mapping.device  # positions: on the host
        total = positions.shape[0]
        prompt = torch.tensor([r.req.prompt_len for r in rows])
        c_prev = np.asarray([r.req.clen for r in rows])  # cache entries before the forward
        m = torch.from_numpy(done + counts)  # true lengths after it
        # the HF cache's schedule, every row at once
        due = (m >= prompt) & should_evict(m - prompt, torch.from_numpy(c_prev + counts), policy, m)
        evicting = due.nonzero().squeeze(-1)
        for r, c in zip(rows, cache_len_after(m, prompt, policy).tolist()):
            r.req.clen = c
        w = policy.observe
        pos_np, prompt_tok = positions.numpy(), prompt.numpy()[tok_row]
        keep = (pos_np >= m.numpy()[tok_row] - w) & (
            (pos_np < prompt_tok) | ((prompt_tok - 1 - pos_np) % policy.interval < w)
        )
        q_tok = torch.from_numpy(np.nonzero(keep)[0])
        q_slot = torch.tensor([r.req.qslot for r in rows], dtype=torch.long)[torch.from_numpy(tok_row)][q_tok]
        q_pos = positions[q_tok]
        plan.q_tok, plan.q_flat = q_tok.to(dev), (q_slot * w + q_pos % w).to(dev)
        ring_pos = self.ring.positions(w, step.slots, dev)
        if step.fresh:  # slots are reused: forget the previous request's queries
            ring_pos[torch.tensor(step.fresh, dtype=torch.long, device=dev)] = -1
        ring_pos.view(-1).index_copy_(0, plan.q_flat, q_pos.to(dev))
        # remap: token j of a row goes to logical slot c_prev + j
        logical = torch.from_numpy(c_prev[tok_row] + step.offs)
        bt = step.input_batch.block_table[0].block_table.cpu[: len(rows)]  # cm.block_table_tensor's, on the host
        phys = bt[torch.from_numpy(tok_row), logical // block_size].long() * block_size + logical % block_size
        cm.slot_mapping[:total].copy_(phys.to(cm.slot_mapping.dtype))
        plan.kernel_seq_lens = torch.from_numpy(c_prev + counts).to(cm.seq_lens.device, cm.seq_lens.dtype)
        if len(evicting):
            ev = evicting.numpy()
            plan.evict = self._evict_batch(
                [rows[i] for i in ev], (c_prev + counts)[ev], cm.block_table_tensor[evicting.to(dev)], block_size
            )
        self.deferred = plan.evict

    def _evict_batch(self, rows: list[RowPlan], n: np.ndarray, blocks: Tensor, block_size: int) -> EvictBatch:
        dev = blocks.device
        width = -(-int(n.max()) // block_size) * block_size  # whole blocks: reads are views, not copies
        pad = torch.arange(width, device=dev)[None, None, :] >= torch.from_numpy(n).to(dev)[:, None, None]
        qslot = torch.tensor([r.req.qslot for r in rows], dtype=torch.long)
        m = torch.tensor([r.m for r in rows], dtype=torch.int32)
        generators = events = None
        if self.sample:
            generators = [r.req.generator for r in rows]
            events = torch.zeros(len(rows), *self.geometry)
            for i, r in enumerate(rows):
                r.req.events[r.m - r.req.prompt_len] = events[i]
        per_call = 1 if "layer" in self.policy.reads else -(-EVICT_ROWS // len(rows))
        return EvictBatch(
            rows,
            width,
            blocks[:, : width // block_size],
            pad,
            qslot.to(dev),
            qslot,
            m,
            generators,
            events,
            min(per_call, self.geometry[0]),
        )

    def kv_update(self, call: LayerCall) -> None:
        """vLLM's write at the remapped slots, then the new tokens' positions (and NaN state)."""
        plan, kv_cache = call.plan, call.kv_cache
        side = self.sides.for_layer(call.name, kv_cache)
        call.stock()  # with the remapped slot_mapping
        if plan.side_addr is None:  # the same for every layer of the forward
            bs, h = kv_cache.shape[2], kv_cache.shape[1]
            slots = call.slot_mapping[: plan.positions.shape[0]].long()
            heads = torch.arange(h, device=slots.device)
            flat = ((slots // bs)[:, None] * h + heads) * bs + (slots % bs)[:, None]  # [T, H]
            plan.side_addr = (flat.view(-1), plan.positions.to(torch.int32).repeat_interleave(h))
        flat, pos = plan.side_addr
        side.pos.view(-1).index_copy_(0, flat, pos)
        if side.state is not None:
            side.state.view(-1, side.state.shape[-1]).index_fill_(0, flat, float("nan"))

    def attention(self, call: LayerCall) -> None:
        """vLLM's attention over the packed caches, the queries into the ring, then the eviction."""
        call.stock()
        self._observe(call.plan, call.index, call.query)
        eb = call.plan.evict
        if eb is not None:
            # Layers hold their own caches, so a layer's eviction may wait for later layers'
            # attention and run with theirs (EVICT_ROWS); the last layer runs what is left.
            eb.layers.append(EvictLayer(call.index, call.name, call.layout, call.kv_cache, call.scale))
            eb.attended += 1
            if len(eb.layers) == eb.per_call or eb.attended == self.geometry[0]:
                self._evict(eb, eb.layers)
                eb.layers = []

    def _observe(self, plan: StepPlan, layer_idx: int, query: Tensor) -> None:
        if plan.q_tok.numel() == 0:
            return
        ring = self.ring.for_layer(layer_idx, query)
        total = plan.positions.shape[0]
        # A decode-only forward keeps every token's query (q_tok = 0..T−1): no gather first.
        kept = query[:total] if plan.q_tok.numel() == total else query.index_select(0, plan.q_tok)
        ring.view(-1, *query.shape[1:]).index_copy_(0, plan.q_flat, kept)

    def _evict(self, eb: EvictBatch, layers: list[EvictLayer]) -> None:
        """Score, select and compact the caches of every request in ``eb`` at each of
        ``layers`` (already attended) as one batch, row l·R + i = layer l, request i. Shorter
        caches are padded to the longest (position −1: no policy keeps or counts them, and
        each request keeps ``budget_at(its length)`` of its own slots)."""
        start = time.perf_counter()
        policy, reads, r = self.policy, self.policy.reads, len(eb.rows)
        sides = [self.sides[lay.name] for lay in layers]

        def stacked(parts: list) -> Tensor | None:
            return None if parts[0] is None else parts[0] if len(parts) == 1 else torch.cat(parts)

        keys = values = queries = None  # what the policy scores from; the compaction reads nothing
        if reads & {"keys", "values"}:
            kv = [lay.layout.read(lay.kv_cache, eb.blocks, eb.n, values="values" in reads) for lay in layers]
            # keys are transposed views of [.., D, N] (CPULayout.read): stacked in that layout
            keys = stacked([k.transpose(-1, -2) for k, _ in kv]).transpose(-1, -2)  # [L·R, H, N, D]
            values = stacked([v for _, v in kv])
        read = [side.read(eb.blocks, eb.n) for side in sides]
        pos = stacked([p for p, _ in read]).masked_fill(eb.pad.repeat(len(layers), 1, 1), -1)
        state = stacked([s for _, s in read])
        qp = self.ring.pos[eb.qslot]  # [R, W] ring order; −1 = no query yet
        order = qp.argsort(-1)  # by position: empty ring entries first, then the queries in order
        w, (hq, d) = qp.shape[1], self.ring.queries[layers[0].index].shape[2:]
        if "queries" in reads:
            ring_rows = (eb.qslot[:, None] * w + order).view(-1)
            queries = stacked(
                [self.ring.queries[lay.index].view(-1, hq, d).index_select(0, ring_rows) for lay in layers]
            )
            queries = queries.view(len(layers) * r, w, hq, d).transpose(1, 2).contiguous()  # [L·R, Hq, W, D]
        fields = (keys, values, queries, pos, qp.gather(-1, order).repeat(len(layers), 1), state)
        layer, scale = layers[0].index if len(layers) == 1 else -1, layers[0].scale
        # Scored a group of rows at a time, the group's [rows, Hq, W, N] logits within
        # SCORE_LOGITS: the temporaries of window attention and redundancy then stay in the
        # CPU's caches (rows are independent, so the result is the same).
        rows = max(1, SCORE_LOGITS // max(1, hq * w * pos.shape[2]))
        # each request's generator draws layer by layer, as at one layer per call
        generators = None if eb.generators is None else eb.generators * len(layers)
        ev = evict(
            policy,
            Observation(*fields, layer, scale),
            sample=self.sample,
            generator=generators,
            score_rows=rows,
            layers=[lay.index for lay in layers],  # names the layer of a non-finite score
        )
        keep, counts = ev.keep, ev.count  # [L·R, H, K]; row j keeps keep[j, :, :counts[j]]
        j, h, n = ev.dead
        j, h, dead = j.cpu(), h.cpu(), pos[j, h, n].cpu()
        layer_of = torch.tensor([lay.index for lay in layers])
        # the last query of the forward saw them
        self.deaths[eb.qslot_host[j % r], layer_of[j // r], h, dead] = eb.m[j % r]
        kept_pos = pos.gather(-1, keep)
        kept_state = None if ev.state is None else gather_slots(ev.state, keep)
        for li, (lay, side) in enumerate(zip(layers, sides)):
            own = slice(li * r, (li + 1) * r)
            c = None if counts is None else counts[own]
            lay.layout.compact(lay.kv_cache, eb.blocks, keep[own], c)
            side.write_prefix(eb.blocks, kept_pos[own], None if kept_state is None else kept_state[own], c)
            if ev.logprob is not None:
                eb.events[:, lay.index] = ev.logprob[own].float().cpu()
        share = (time.perf_counter() - start) / r
        for row in eb.rows:
            row.req.evict_seconds += share


__all__ = ["EVICT_ROWS", "SCORE_LOGITS", "EvictingWorker", "QueryRing", "cache_len_after"]
