"""Per-head compacting KV cache for transformers, and the eviction trace it records.

Every kvrl compression method is a KV policy acting on a per-(layer, KV head) cache, and
every rollout leaves an **eviction trace** (``docs/architecture.md``):

* :class:`EvictionTrace` — ``death[layer, b, kv_head, k]`` = the first query position
  that no longer sees key position k. Query q sees key k iff ``k <= q < death[k]``.
* :class:`KVCache` — a ``transformers.cache_utils.Cache`` whose layers (:class:`KVLayer`)
  hold, per KV head, their own kept tokens with their true positions and per-token policy
  state, plus the last post-RoPE queries the policy observes.

Eviction happens inside the registered attention function ``"kvrl_evict"``, because only
the attention function sees the queries. The engine passes the cache twice,
``model(..., past_key_values=cache, kvrl_cache=cache)``: transformers hands the first to
the layers' ``update`` and forwards the second, an unknown keyword, to the attention
function (``generate()`` refuses unknown keywords, hence the engine's own decode loop).
Before each forward the engine calls :meth:`KVCache.begin` with the true positions of the
new tokens and the number of generated tokens they bring into the cache; the schedule
(:func:`kvrl.policies.should_evict`) decides whether this forward ends with an eviction.

The cache runs one regime (:mod:`kvrl.policies.regime`): ``Full`` only appends;
``Evicting`` evicts on the policy's schedule; ``Static`` (head allocation, sink+recent)
masks keys by the pattern's death times instead of evicting them, which is equivalent;
``Mixed`` (RLKV) keeps every key and attends with
:func:`kvrl.kernels.reference.mixed.mixed_gate_attention` over the cache's per-head key positions.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer

from kvrl.kernels import gather_slots
from kvrl.kernels.reference.mixed import mixed_gate_attention
from kvrl.kernels.reference.replay import NEVER, Replay, visibility
from kvrl.policies.base import Observation, should_evict
from kvrl.policies.evict import Eviction, evict
from kvrl.policies.regime import Evicting, Mixed, Static, as_regime


@dataclass
class EvictionTrace:
    """Which key each KV head stopped seeing when, for a batch of sequences.

    Attributes
    ----------
    death : Tensor [layers, B, H_kv, T] int16 or int32
        Indexed by true key position: the first query position that no longer sees the
        key. Stored compactly: int16 when T < 32767, else int32, with "never evicted" as
        the dtype's max (:attr:`never`; ``NEVER`` for int32). :meth:`full` gives int32
        with ``NEVER`` for ops. Deaths ≥ T (no query of the trace is affected) are
        stored as never, so equal behaviour gives equal traces.
    lengths : Tensor [B] int64
        Positions ``0 … lengths[b]−1`` belong to sequence b (prompt + generated tokens,
        the stop token included); the rest of T is padding of the batch.
    logprob : Tensor [events, layers, B, H_kv] float32 or None
        Sampled evictions only: log-probability of each eviction's action (0 where a row
        evicted nothing). Events are in decoding order.
    """

    death: Tensor
    lengths: Tensor
    logprob: Tensor | None = None

    @classmethod
    def from_death(cls, death: Tensor, lengths: Tensor, logprob: Tensor | None = None) -> EvictionTrace:
        """Canonical compact trace from an int death tensor [layers, B, H_kv, T] whose
        never-evicted keys hold any value ≥ T (``NEVER``, or a smaller dtype's max)."""
        T = death.shape[-1]
        dtype = torch.int16 if T < torch.iinfo(torch.int16).max else torch.int32
        never = death.long() >= T
        death = death.masked_fill(never, 0).to(dtype).masked_fill(never, torch.iinfo(dtype).max)
        return cls(death, torch.as_tensor(lengths, dtype=torch.int64, device=death.device), logprob)

    @property
    def never(self) -> int:
        return torch.iinfo(self.death.dtype).max

    def full(self) -> Tensor:
        """[layers, B, H_kv, T] int32 with ``NEVER`` for never-evicted keys."""
        return self.death.int().masked_fill(self.death == self.never, NEVER)

    def for_sequence(self, b: int) -> EvictionTrace:
        """Sequence b alone, trimmed to its length: [layers, 1, H_kv, lengths[b]]."""
        n = int(self.lengths[b])
        lp = None if self.logprob is None else self.logprob[:, :, b : b + 1]
        return EvictionTrace.from_death(self.full()[:, b : b + 1, :, :n], self.lengths[b : b + 1], lp)

    def retention(self) -> Tensor:
        """[layers, B, H_kv] float: the fraction of causal (query, key) pairs of each
        sequence that the trace leaves visible (1 = full cache). Key k is seen by the
        queries ``k … min(death[k], length) − 1``."""
        T = self.death.shape[-1]
        k = torch.arange(T, device=self.death.device)
        n = self.lengths.to(self.death.device)[None, :, None, None]
        seen = (torch.minimum(self.full().long(), n) - k).clamp(min=0)
        return seen.sum(-1).float() / (n * (n + 1) / 2).squeeze(-1).float()

    def replay(self, key_pos: Tensor, flex: bool | None = None) -> Replay:
        """The attention pattern for a full-sequence forward over slots with true
        positions ``key_pos [B, S]`` (-1 = padding). ``flex`` (default: on CUDA) uses a
        flex-attention BlockMask instead of dense per-layer masks."""
        if int(key_pos.max()) >= self.death.shape[-1]:
            raise ValueError(
                f"the trace covers {self.death.shape[-1]} positions, the sequences need {int(key_pos.max()) + 1}"
            )
        return Replay(self.full().to(key_pos.device), key_pos, flex=key_pos.is_cuda if flex is None else flex)

    def save(self, path: str | Path) -> None:
        tensors = {"death": self.death, "lengths": self.lengths}
        if self.logprob is not None:
            tensors["logprob"] = self.logprob
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> EvictionTrace:
        t = load_file(str(path))
        return cls(t["death"], t["lengths"], t.get("logprob"))


class KVLayer(DynamicLayer):
    """One layer of :class:`KVCache`.

    keys, values: [B, H, N, D] (post-RoPE); key_pos: [B, H, N] true positions, −1 for
    padding; state: [B, H, N, S] float32 per-token policy state, NaN for tokens that have
    none yet (None when S = 0); queries: [B, Hq, W, D] the last W ≤ ``observe`` post-RoPE
    queries and query_pos: [B, W] their positions (−1 = padding). Every head holds N slots;
    a head that keeps fewer real tokens holds padding slots.
    """

    def __init__(self, state_size: int = 0, observe: int = 0):
        super().__init__()
        self.state_size, self.observe = state_size, observe
        self.key_pos = self.state = self.queries = self.query_pos = None

    def update(self, key_states: Tensor, value_states: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Append new keys/values [B, H, Q, D] at true positions pos [B, Q]."""
        if pos is None:
            raise ValueError(
                "a KVCache forward needs the true positions of its tokens: call cache.begin(positions, "
                "generated) before model(...), or run model.generate(..., past_key_values=cache) "
                "inside `with kvrl.cache.generating(model):`"
            )
        keys, values = super().update(key_states, value_states)
        new = pos[:, None, :].expand(-1, key_states.shape[1], -1)
        self.key_pos = new if self.key_pos is None else torch.cat([self.key_pos, new], -1)
        if self.state_size:
            nan = torch.full((*new.shape, self.state_size), float("nan"), device=new.device)
            self.state = nan if self.state is None else torch.cat([self.state, nan], 2)
        return keys, values

    def observe_queries(self, query: Tensor, pos: Tensor) -> None:
        """Keep the last ``observe`` queries [B, Hq, W, D] and positions [B, W]."""
        if not self.observe:
            return
        if self.queries is not None:
            query, pos = torch.cat([self.queries, query], 2), torch.cat([self.query_pos, pos], 1)
        self.queries, self.query_pos = query[:, :, -self.observe :], pos[:, -self.observe :]

    def compact(self, keep: Tensor, state: Tensor | None) -> None:
        """Keep slots keep [B, H, K] of every per-token tensor (state: the policy's new one)."""
        self.keys, self.values = gather_slots(self.keys, keep), gather_slots(self.values, keep)
        self.key_pos = gather_slots(self.key_pos, keep)
        self.state = None if state is None else gather_slots(state, keep)

    def _unsupported(self, *args, **kwargs):
        # DynamicLayer's versions would leave key_pos, state and queries out of step.
        raise NotImplementedError("a KVCache layer cannot be cropped or reordered; decode the batch as a whole")

    is_croppable = False
    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


class KVCache(Cache):
    """Per-(layer, KV head) compacting cache; records its :class:`EvictionTrace`.

    Parameters
    ----------
    layers, batch, kv_heads : int
        Model geometry and batch size.
    length : int
        T, positions the trace covers (longest prompt + max new tokens).
    regime : optional
        What the cache does (anything :func:`kvrl.policies.as_regime` takes): None / ``Full``
        only appends; a KVPolicy / ``Evicting`` evicts on its schedule; ``Static`` masks keys
        by its death pattern [layers, B, H_kv, ≥T]; ``Mixed`` attends with RLKV's gates.
    sample : bool
        Sample evictions (``policy.select(sample=True)``) and record their logprobs.
    generator : torch.Generator, optional
        For sampled evictions.
    """

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        length: int,
        regime=None,
        *,
        sample: bool = False,
        generator: torch.Generator | None = None,
        device=None,
    ):
        regime = as_regime(regime)
        policy = regime.policy if isinstance(regime, Evicting) else None
        state, observe = (policy.state_size, policy.observe) if policy is not None else (0, 0)
        super().__init__(layers=[KVLayer(state, observe) for _ in range(layers)])
        self.policy, self.static = policy, isinstance(regime, Static)
        self.mixed = regime if isinstance(regime, Mixed) else None
        death = None
        if self.static:
            death = regime.death(length, batch).to(device)
        elif policy is not None:  # record in the trace's compact dtype
            dtype = torch.int16 if length < torch.iinfo(torch.int16).max else torch.int32
            death = torch.full((layers, batch, kv_heads, length), torch.iinfo(dtype).max, dtype=dtype, device=device)
        self.death = death
        self.sample, self.generator = sample, generator
        self.step_pos, self.evict_now = None, False
        self.forwards = 0  # begin() calls so far: under generating(), the generated tokens in the cache
        self.logprobs: list[Tensor] = []  # per sampled eviction event: [layers, B, H]
        self.evict_seconds = 0.0  # wall time spent scoring, selecting and compacting

    @classmethod
    def for_model(cls, model, batch: int, length: int, regime=None, **kwargs) -> KVCache:
        """A cache of ``model``'s geometry (its config's layers and KV heads) on its device."""
        cfg = model.config
        return cls(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, length, regime, device=model.device, **kwargs)

    def begin(self, pos: Tensor, generated: int) -> None:
        """Announce the next forward: true positions pos [B, Q] (−1 = padding) of its
        tokens, after which ``generated`` generated tokens are in the cache."""
        self.step_pos = pos
        self.forwards += 1
        # One schedule for the batch, due when the shortest row (the smallest budget) is
        # over; rows within their own budget then keep everything (apply).
        self.evict_now = self.policy is not None and should_evict(
            generated, self.get_seq_length() + pos.shape[1], self.policy, int(pos.amax(-1).min()) + 1
        )
        if self.evict_now and self.sample:
            self.logprobs.append(torch.zeros(len(self.layers), *self.death.shape[1:3], device=pos.device))

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, self.step_pos)

    def evict(self, layer_idx: int, scaling: float) -> None:
        """Score, select and compact one layer; record the deaths of the evicted keys."""
        start = time.perf_counter()
        obs = self.observation(layer_idx, scaling)
        # A forward under autocast (TRL's or accelerate's bf16) would run the policy's matmuls in
        # bfloat16: policies score in float32, as specified (and as the C++ score ops require)
        with torch.autocast(obs.key_pos.device.type, enabled=False):
            ev = evict(self.policy, obs, sample=self.sample, generator=self.generator)
        self._apply(layer_idx, ev)
        if ev.logprob is not None:
            self.logprobs[-1][layer_idx] = ev.logprob
        self.evict_seconds += time.perf_counter() - start

    def observation(self, layer_idx: int, scaling: float) -> Observation:
        """What the policy sees of layer ``layer_idx`` now (after this step's forward)."""
        layer = self.layers[layer_idx]
        return Observation(
            layer.keys, layer.values, layer.queries, layer.key_pos, layer.query_pos, layer.state, layer_idx, scaling
        )

    def apply(self, layer_idx: int, keep: Tensor, state: Tensor | None, count: Tensor | None = None) -> None:
        """Keep slots keep [B, H, K] of layer ``layer_idx`` (state: the policy's updated
        per-token state) and record the deaths of the others; with ``count`` [B], row b
        keeps only ``keep[b, :, :count[b]]`` (:class:`kvrl.policies.Selection`): the slots
        after it stay in the layout as padding. ForesightKV's eviction MDP calls it with an
        action chosen outside the forward (:mod:`kvrl.envs.eviction`)."""
        self._apply(layer_idx, Eviction.of(keep, count, self.layers[layer_idx].key_pos, state))

    def _apply(self, layer_idx: int, ev: Eviction) -> None:
        layer, state = self.layers[layer_idx], ev.state
        valid = layer.key_pos >= 0
        length = layer.key_pos.amax((-2, -1)) + 1  # [B] true lengths: the newest token is cached
        over = valid.sum(-1).amax(-1) > self.policy.budget_at(length)  # [B]: rows that evict when decoded alone
        if state is not None and not bool(over.all()):
            # The schedule is shared by the batch, but a row within its budget would not
            # have been scored alone: it keeps all its keys (K >= its valid count) and its state.
            previous = self.policy.previous_state(self.observation(layer_idx, 1.0))
            state = torch.where(over[:, None, None, None], state, previous)
        b, h, n = ev.dead
        # The last query of row b in this forward saw the key; the next one does not.
        self.death[layer_idx, b, h, layer.key_pos[b, h, n]] = (self.step_pos[b, -1] + 1).to(self.death.dtype)
        layer.compact(ev.keep, state)
        if ev.mine is not None:  # a row below K in ratio mode: its fill becomes padding
            layer.key_pos = layer.key_pos.masked_fill(~ev.mine, -1)
            if layer.state is not None:
                layer.state = layer.state.masked_fill(~ev.mine[..., None], float("nan"))

    def trace(self, lengths: Tensor) -> EvictionTrace:
        """The recorded trace; lengths [B] = prompt + generated tokens of each row."""
        logprob = torch.stack(self.logprobs) if self.logprobs else None
        return EvictionTrace.from_death(self.death, lengths, logprob)


def evict_attention(
    module, query, key, value, attention_mask, *, scaling, dropout=0.0, kvrl_cache: KVCache | None = None, **kwargs
):
    """transformers attention function ``"kvrl_evict"``: attend over the compacting cache,
    then evict if this forward is an eviction step.

    query [B, Hq, Q, D] post-RoPE; key/value [B, H, N, D] = the layer's cache after
    ``update`` -> (out [B, Q, Hq, D], None). The mask comes from the cache's per-head true
    positions (causal, padding excluded, and the static pattern if any); transformers'
    2-D padding mask no longer describes a compacted cache and is ignored. Under ``Mixed``
    the attention is :func:`~kvrl.kernels.reference.mixed.mixed_gate_attention` over the same key
    positions (padding queries clamped to position 0, as in ``HFEngine.score``).
    """
    if kvrl_cache is None:
        raise ValueError("attn_implementation='kvrl_evict' needs model(..., kvrl_cache=KVCache(...))")
    cache, idx = kvrl_cache, module.layer_idx
    layer = cache.layers[idx]
    if cache.mixed is not None:
        m = cache.mixed
        out = mixed_gate_attention(
            query,
            key,
            value,
            cache.step_pos.clamp(min=0),
            layer.key_pos,
            m.gates[idx],
            sink=m.sink,
            recent=m.recent,
            scaling=scaling,
        )
        return out.transpose(1, 2).contiguous(), None
    layer.observe_queries(query, cache.step_pos)
    if cache.static:
        death = cache.death[idx]
        death_slots = death.gather(-1, layer.key_pos.clamp(min=0))
    else:
        death_slots = torch.full((1, 1, 1), NEVER, device=key.device)
    allowed = visibility(death_slots, layer.key_pos, cache.step_pos)
    # Padding queries see nothing; give them their whole row so softmax stays finite.
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=allowed.repeat_interleave(query.shape[1] // key.shape[1], dim=1),
        scale=scaling,
        enable_gqa=True,
    )
    if cache.evict_now:
        cache.evict(idx, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("kvrl_evict", evict_attention)


@contextmanager
def generating(model):
    """Inside it, ``model.generate(..., past_key_values=cache)`` (and ``model(...)``) with a
    :class:`KVCache` decodes under the cache's regime; afterwards ``cache.trace(lengths)`` is
    its eviction trace. Greedy and sampled decoding alike; not beam search (the cache cannot
    be reordered).

    A forward pre-hook on ``model`` reads each forward's true positions from its 2-D
    ``attention_mask`` (left padding = 0; without one, from ``position_ids``), calls
    :meth:`KVCache.begin` with them and the number of forwards before this one (the generated
    tokens the forward brings into the cache, as the engine's loop counts them) and hands the
    cache to the ``"kvrl_evict"`` attention function, which ``generate()`` would refuse as an
    unknown keyword. The model's attention implementation and hooks are restored on exit.
    Forwards given another ``past_key_values``, or a ``kvrl_cache`` (a caller that calls
    :meth:`KVCache.begin` itself, as :class:`kvrl.engines.hf.HFEngine`), are left alone.
    """

    def begin(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if not isinstance(cache, KVCache) or "kvrl_cache" in kwargs:  # the caller drives it (HFEngine)
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows, q = (ids if ids is not None else kwargs["inputs_embeds"]).shape[:2]
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if mask is not None and mask.dim() == 2:
            # generate's mask spans every token so far; true positions count the unpadded ones
            pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, -1)[:, -q:]
        elif positions is not None:
            pos = positions.expand(rows, -1)
        else:
            # the cache's length is not the next position once it has evicted
            raise ValueError(
                "a forward on a KVCache needs the true positions of its tokens: pass a 2-D "
                "attention_mask or position_ids"
            )
        cache.begin(pos, generated=cache.forwards)
        return args, {**kwargs, "kvrl_cache": cache}

    handle = model.register_forward_pre_hook(begin, with_kwargs=True)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvrl_evict")
    try:
        yield model
    finally:
        handle.remove()
        model.set_attn_implementation(previous)
