"""The per-process state of kvrl's vLLM worker, shared by the CPU and CUDA backends.

Everything here is layout-agnostic: the backends (``cpu_backend``, ``cuda_backend``) only say how a
layer's paged cache tensor stores K and V (a :class:`kvrl.engines.vllm.layout.PagedLayout`) and call
the hooks of :class:`WorkerContext` from their metadata builder and attention (:mod:`.shim`).

How a request's cache is laid out
---------------------------------
vLLM keeps allocating blocks and computing positions, ``num_computed_tokens`` and block tables for
the *true* sequence; only the attention metadata is remapped. Per (layer, KV head) the kept tokens
are packed, in position order, into the request's first logical slots (logical slot j = block
``block_table[j // bs]``, offset ``j % bs``). Next to K/V, two side tensors indexed by the same
(block, head, offset) hold each slot's true position and the policy's per-token state
(:class:`kvrl.engines.vllm.layout.SideStores`), compacted together with K/V. The last ``observe``
post-RoPE queries of each request and layer sit in a ring buffer (:class:`.evicting.QueryRing`).

What this module owns
---------------------
:class:`WorkerContext` keeps what outlives a regime: the runner, the requests (their
:class:`kvrl.engines.vllm.steps.ReqState` and ring slots, finished ones until popped), the
side stores and the query ring. It plans the rows of each forward (``plan_step``) and hands the rest
to the installed regime's worker, one module each, chosen by type at :meth:`WorkerContext.set_policy`:

* ``Full`` → :class:`.full.FullWorker`: vLLM untouched;
* ``Evicting`` → :class:`.evicting.EvictingWorker`: a KV policy evicts tokens as requests decode;
* ``Static`` → :func:`.static.static_worker`: a fixed death pattern (sink + recent heads, pooled or not);
* ``Mixed`` → :class:`.mixed.MixedWorker`: RLKV's mixed-gate attention.

There is one context per engine, found by :func:`context` from the engine's ``VllmConfig`` (vLLM
builds the builder and the worker extension and passes them no kvrl object; the builder hands its
context to the layers in the attention metadata), so two engines in one process (inline rollout
workers, ``workers.address=inline``) keep their own requests, traces and regimes.
:meth:`WorkerContext.push_cache_state` loads new trainable state (gates, a scorer) into the
installed regime (``regime.load_state``), which its worker reads in place, and returns its checksum.

Refusals: a request seen for the first time with computed tokens (prefix caching, a KV
connector) and a request whose computed tokens went back (preemption/recompute) raise
:class:`EvictionRefused` — a recompute would not replay the incremental evictions.
:func:`check_config` refuses the rest before the first request, tensor parallelism and async
scheduling among them (why: ``docs/architecture.md``, "Compressed decoding in the vLLM engine").
"""

from __future__ import annotations

import copy
import weakref

import numpy as np
import torch
from torch import Tensor

from kvrl.engines.vllm.evicting import EvictingWorker, QueryRing
from kvrl.engines.vllm.full import FullWorker
from kvrl.engines.vllm.kv_manager import parse_pool
from kvrl.engines.vllm.layout import SideStores
from kvrl.engines.vllm.mixed import MixedWorker
from kvrl.engines.vllm.static import static_worker
from kvrl.engines.vllm.steps import LayerCall, RegimeWorker, ReqState, RowPlan, StepInput, StepPlan
from kvrl.policies.regime import Evicting, Full, Mixed, Static, as_regime, checksum


class EvictionRefused(RuntimeError):
    """A vLLM feature or event that would silently corrupt a compacted cache."""


class WorkerContext:
    """The kvrl state of one engine's vLLM worker (:func:`context`)."""

    def __init__(self):
        self.runner = None
        self.vllm_config = None
        self.regime = None  # the installed regime (a copy of the engine's)
        self.worker: RegimeWorker = FullWorker()  # the installed regime's part
        self.sample = False
        self.active: dict[str, ReqState] = {}  # vLLM request id -> state
        self.finished: dict[str, ReqState] = {}  # tag -> state, until popped
        self.sides = SideStores()
        self.ring = QueryRing()
        self.free_slots: list[int] = []  # ring slots of finished requests, handed out again
        self.n_slots = 0
        self.geometry: tuple[int, int] | None = None  # (layers, kv heads)
        self.device = torch.device("cpu")

    # ---- control (called through the worker extension) ----

    def attach(self, runner, vllm_config) -> None:
        self.runner, self.vllm_config = runner, vllm_config
        self.device = torch.device(getattr(runner, "device", "cpu"))
        cfg = vllm_config.model_config
        self.geometry = (
            cfg.get_num_layers(vllm_config.parallel_config),
            cfg.get_num_kv_heads(vllm_config.parallel_config),
        )

    def set_policy(self, regime=None, *, sample: bool = False) -> None:
        """Install a cache regime (or anything :func:`kvrl.policies.as_regime` takes) for the
        next requests; ``Full`` leaves vLLM untouched."""
        regime = as_regime(regime)
        # Engines call this between synchronous generate() calls: whatever is still listed
        # as active has finished (vLLM's runner forgets requests one step late).
        self.active.clear()
        self.finished.clear()
        self.free_slots, self.n_slots = [], 0
        if not isinstance(regime, Full):
            check_config(self.vllm_config)
        self.regime = copy.deepcopy(regime)
        self.sample = sample
        self.worker = self._worker_for(self.regime)
        self.sides.resize(self.worker.state_size)

    def _worker_for(self, regime) -> RegimeWorker:
        """The installed regime's worker; it works on the regime itself, so a pushed state
        (``regime.load_state``) reaches it."""
        match regime:
            case Full():
                return FullWorker()
            case Evicting(policy=policy):
                module = policy.trainable()
                if module is not None:
                    module.to(self.device)
                return EvictingWorker(policy, self.sample, self.geometry, self.sides, self.ring)
            case Static():
                return static_worker(regime, self.geometry, self.sides)
            case Mixed():
                return MixedWorker(regime)

    def push_cache_state(self, state: dict) -> str:
        """Load new trainable state into the installed regime (``regime.load_state``, which
        raises on a name or shape mismatch); returns the checksum of the state it now holds."""
        if self.regime is None:
            raise ValueError(
                "no cache regime installed: generate once with the regime (Mixed, Evicting with "
                "a learned scorer) before pushing its state"
            )
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
            out.append(
                None if st is None else {"death": st.death, "events": st.events, "evict_seconds": st.evict_seconds}
            )
        return out

    # ---- builder side ----

    def _release_finished(self) -> None:
        live = self.runner.requests
        for rid in [r for r in self.active if r not in live]:
            st = self._release(rid)
            self.finished[st.tag] = st

    def _release(self, rid: str) -> ReqState:
        st = self.active.pop(rid)
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
        self.worker.admit(st)
        if st.pooled and not self.worker.pools:
            raise RuntimeError(
                f"request {rid} asks for pooled heads, but the installed regime is not a sink + recent pattern"
            )
        return st

    def plan_step(self, cm, block_size: int) -> StepPlan | None:
        """Plan one forward from the common attention metadata: its rows here, the rest by the
        installed regime (the evicting one rewrites ``cm.slot_mapping`` in place, which the
        forward context holds, and returns the kernel's lengths as ``plan.kernel_seq_lens``)."""
        if self.runner is None or not self.worker.plans:
            return None
        ib = self.runner.input_batch
        n = ib.num_reqs
        if n == 0:
            return None
        self._release_finished()
        qsl = cm.query_start_loc_cpu[: n + 1].tolist()
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
        self.worker.plan(
            plan, StepInput(cm, ib, block_size, positions, counts, tok_row, offs, done, fresh, self.n_slots)
        )
        return plan

    def _plan_rows(
        self, ib, n: int, qsl: list[int], counts: np.ndarray, bt_dev: Tensor
    ) -> tuple[list[RowPlan], list[int]]:
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
                        "connector): kvrl's compacted cache must see every token from the start"
                    )
                st = self.active[rid] = self._new_request(rid, int(nprompt[i]))
                fresh.append(st.qslot)
            elif done != st.done:
                raise EvictionRefused(
                    f"request {rid} was preempted and is being recomputed ({st.done} -> {done} computed "
                    "tokens); a recompute does not replay the evictions. Give vLLM more KV cache "
                    "(VLLM_CPU_KVCACHE_SPACE / gpu_memory_utilization) or lower max_num_seqs"
                )
            q = int(counts[i])
            row = RowPlan(st, qsl[i], q, done, bt_dev[i] if self.worker.row_blocks else None)
            st.done = done + q
            rows.append(row)
        return rows, fresh

    # ---- layer side ----

    def kv_update(self, call: LayerCall) -> None:
        """Write the forward's new keys/values (and their positions/state) to the layer's cache."""
        self.worker.kv_update(call)

    def attention(self, call: LayerCall) -> None:
        """Attention of the forward into ``call.output`` [T, Hq, D], then this layer's eviction;
        ``call.key``/``call.value`` [T, H, D] are the forward's new ones (pooled prompt chunks read them)."""
        self.worker.attention(call)


def check_config(vllm_config) -> None:
    """Refuse vLLM features that would corrupt a compacted cache (raises ValueError)."""
    if vllm_config is None:
        raise RuntimeError("the kvrl worker context is not attached: create engines with VLLMEngine")
    problems = []
    cc = vllm_config.cache_config
    if cc.enable_prefix_caching:
        problems.append(
            "prefix caching (enable_prefix_caching=False): compaction rewrites blocks other requests would share"
        )
    if str(getattr(cc, "cache_dtype", "auto")) != "auto":
        problems.append(f"a quantized KV cache (kv_cache_dtype={cc.cache_dtype}): policies read K/V as stored")
    if vllm_config.speculative_config is not None:
        problems.append(
            "speculative decoding: rejected drafts roll back computed tokens the eviction schedule has already counted"
        )
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


# id(VllmConfig) -> (a weak reference to it, its context); an entry goes with its config
CONTEXTS: dict[int, tuple[weakref.ref, WorkerContext]] = {}


def context(vllm_config) -> WorkerContext:
    """The worker context of the engine whose config is ``vllm_config``, made on first use."""
    key = id(vllm_config)
    entry = CONTEXTS.get(key)
    if entry is None or entry[0]() is not vllm_config:
        entry = CONTEXTS[key] = (weakref.ref(vllm_config), WorkerContext())
        weakref.finalize(vllm_config, CONTEXTS.pop, key, None)
    return entry[1]


def layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


__all__ = ["CONTEXTS", "EvictionRefused", "WorkerContext", "check_config", "context", "layer_index"]
