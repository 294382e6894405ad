"""ForesightKV's eviction MDP (``kvrl/eviction-v0``): a teacher-forced chunked pass over a
stored reasoning trace, evicting every ``interval`` tokens down to ``budget`` per KV head.

Contract:

* :class:`ChunkedPass` runs the frozen model over one trace in chunks — the prompt, then
  ``interval`` tokens at a time — with a :class:`kvrl.cache.KVCache`; after a chunk that
  leaves more than ``budget`` entries (and before the end) it stops and lets the caller
  choose, per (layer, KV head), the slots to keep. That is exactly what decoding the trace
  with the same policy does (same eviction points, same observed queries), so per-token
  losses under the pass are the losses of the compressed cache.
* :class:`EvictionEnv` is that pass as a :class:`~kvrl.envs.base.TraceEnv`. Observation
  (:class:`EvictionObs`): the scorer features of every cached token (ForesightKV's
  ``[k ‖ v ‖ 8·G attention features]``, maintained by the environment because the running
  attention sums are part of the cache state), the candidate mask (not sink/window) and
  how many slots each head must evict. Action: keep-slot indices ``[layers, 1, H, K]``.
  Reward (last step): ``−Σ_{t∈E} Δ_t²`` with ``Δ_t = loss_t(compressed) − loss_t(full)``
  over E = the tokens among the ``low_entropy`` fraction with the lowest full-cache entropy
  whose loss rose by more than ``eta`` (ForesightKV's reward, summed as in its paper).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvrl.cache import KVCache
from kvrl.envs.base import TraceEnv
from kvrl.policies.base import KVPolicy, geometry
from kvrl.policies.golden import block_bounds
from kvrl.policies.learned import LearnedScorer


class ChunkedPass:
    """One trace (batch 1) through the frozen model with eviction at chunk ends.

    Parameters
    ----------
    model : transformers causal LM
    ids : Tensor [T] int64
        Prompt + generated tokens.
    prompt_len : int
    policy : KVPolicy
        Gives the schedule (budget, interval), what is always kept (sink, window), how many
        queries to observe and the per-token state size. It does not choose: the caller does.
    """

    def __init__(self, model, ids: Tensor, prompt_len: int, policy: KVPolicy):
        cfg = model.config
        self.model, self.policy, self.prompt_len = model, policy, prompt_len
        self.ids = ids.to(model.device).view(1, -1)
        self.ends = block_bounds(self.ids.shape[1], prompt_len, policy.interval)
        self.cache = KVCache.for_model(model, 1, self.ids.shape[1], policy)
        self.scaling = geometry(cfg)["head_dim"] ** -0.5
        self.chunk, self.losses, self.entropies = 0, [], []

    @torch.no_grad()
    def advance(self) -> bool:
        """Run chunks until an eviction is due (True) or the trace ends (False)."""
        T = self.ids.shape[1]
        while self.chunk < len(self.ends):
            start = 0 if self.chunk == 0 else self.ends[self.chunk - 1]
            end = self.ends[self.chunk]
            self.chunk += 1
            pos = torch.arange(start, end, device=self.ids.device)[None]
            self.cache.begin(pos, generated=end - self.prompt_len)
            # the caller evicts after the forward; never after the last chunk (nothing follows)
            due, self.cache.evict_now = self.cache.evict_now and end < T, False
            previous = self.model.config._attn_implementation
            self.model.set_attn_implementation("kvrl_evict")
            try:
                out = self.model(
                    input_ids=self.ids[:, start:end],
                    position_ids=pos,
                    past_key_values=self.cache,
                    use_cache=True,
                    kvrl_cache=self.cache,
                )
            finally:
                self.model.set_attn_implementation(previous)
            # score the tokens this chunk predicts now (P..T-1 over the whole pass), so that no
            # [T, V] logits are kept: one chunk's [end - start, V] at a time
            first = max(start, self.prompt_len - 1)
            last = min(end, T - 1)
            if first < last:
                logp = torch.log_softmax(out.logits[0, first - start : last - start].float(), -1)
                self.losses.append(-logp.gather(-1, self.ids[0, first + 1 : last + 1, None]).squeeze(-1))
                self.entropies.append(-(logp.exp() * logp).sum(-1))
            if due:
                return True
        return False

    def observations(self):
        """Per layer, the :class:`~kvrl.policies.base.Observation` of the pending eviction."""
        return [self.cache.observation(layer, self.scaling) for layer in range(len(self.cache.layers))]

    def apply(self, layer: int, keep: Tensor, state: Tensor | None) -> None:
        """Keep slots keep [1, H, K] of ``layer`` (state: the updated per-token state)."""
        self.cache.apply(layer, keep, state)

    def scores(self) -> tuple[Tensor, Tensor]:
        """Per generated token: loss and entropy [T − prompt_len] under the pass so far
        (call after :meth:`advance` returned False)."""
        return torch.cat(self.losses), torch.cat(self.entropies)


def run_policy(model, ids: Tensor, prompt_len: int, policy: KVPolicy) -> ChunkedPass:
    """The chunked pass with ``policy`` choosing deterministically (``select``)."""
    run = ChunkedPass(model, ids, prompt_len, policy)
    while run.advance():
        for obs in run.observations():
            scores, state = policy.score(obs)
            run.apply(obs.layer, policy.select(obs, scores).keep, state)
    return run


def hurt_penalty(loss: Tensor, full_loss: Tensor, entropy: Tensor, eta: float, low_entropy: float) -> tuple[float, int]:
    """(Σ_{t∈E} Δ_t², |E|): ForesightKV's penalty (the reward is its negative).

    Δ = loss − full_loss per generated token; E = tokens whose full-cache entropy is among
    the ``low_entropy`` fraction of lowest (high-entropy tokens are uncertain anyway) and
    whose loss rose by more than ``eta``.
    """
    delta = loss.double() - full_loss.double()
    n_low = max(1, int(round(low_entropy * len(entropy))))
    low = torch.zeros_like(delta, dtype=torch.bool)
    low[entropy.argsort(stable=True)[:n_low]] = True
    hurt = low & (delta > eta)
    return float((delta[hurt] ** 2).sum()), int(hurt.sum())


@dataclass
class EvictionObs:
    """The state at one eviction step of :class:`EvictionEnv` (stacked over layers).

    features [layers, 1, H, N, F] the scorer input of every slot (0 at padding slots);
    key_pos [layers, 1, H, N] true positions (−1 = padding); candidates [layers, 1, H, N]
    bool, the slots the action may evict (valid, not sink/window); n_evict [layers, 1, H]
    how many must go; step: the eviction index in the episode; budget: K slots kept.
    """

    features: Tensor
    key_pos: Tensor
    candidates: Tensor
    n_evict: Tensor
    step: int
    budget: int


class EvictionEnv(TraceEnv):
    """ForesightKV's eviction MDP over stored traces (see the module docstring).

    Parameters
    ----------
    traces : sequence of traces
        Objects with ``ids`` (prompt + completion token ids), ``prompt_len`` and the
        full-cache per-token ``loss`` and ``entropy`` of the completion — what
        :func:`kvrl.data.traces.load_traces` reads from a data step's folder.
    model : transformers causal LM
        The frozen LLM, loaded by the job (the framework owns models; environments never
        load one).
    budget, interval, window, sink : int
        The eviction setting (as :class:`~kvrl.policies.KVPolicy`).
    eta, low_entropy : float
        Reward parameters (:func:`hurt_penalty`).
    shuffle : bool
        Visit the traces in a per-epoch permutation drawn from ``np_random``.

    ``reset(options={"trace": i})`` starts an episode on trace i (GRPO rolls several
    episodes of one trace, drawn with :meth:`next_trace`); otherwise the next trace of the
    stream. ``options={"budget": k}`` evicts that episode down to k tokens instead of ``budget``
    (ForesightKV trained over a range of budgets, ``foresight.budgets``); k must leave something to
    evict (window + sink + 1 <= k < the trace's length − interval). ``info`` of the last
    step: ``penalty``, ``hurt`` (|E|), ``loss_sum`` and ``full_loss_sum`` (over the generated
    tokens), their ratio ``loss_ratio`` and the episode's ``budget``.
    """

    def __init__(
        self,
        traces: Sequence,
        model,
        *,
        budget: int,
        interval: int,
        window: int = 8,
        sink: int = 4,
        eta: float = 1.5,
        low_entropy: float = 0.8,
        shuffle: bool = True,
    ):
        self.traces = list(traces)
        if not self.traces:
            raise ValueError(
                "no traces: generate them with `python -m kvrl.run recipe=tiny_foresight "
                "job=foresight_traces` and pass kvrl.data.traces.load_traces(<folder>)"
            )
        short = sum(len(t.ids) <= budget + interval for t in self.traces)
        if short:
            raise ValueError(
                f"{short} of {len(self.traces)} traces have at most budget + interval = "
                f"{budget + interval} tokens, so nothing would be evicted; lower the budget or keep "
                "longer traces (foresight.min_tokens)"
            )
        self.model = model
        self.features = LearnedScorer(
            budget=budget, interval=interval, window=window, sink=sink, **geometry(self.model.config)
        )
        self.eta, self.low_entropy, self.shuffle = eta, low_entropy, shuffle
        longest = max(len(t.ids) for t in self.traces)
        self.max_steps = 1 + -(-longest // interval)  # an eviction per chunk at most, plus the end
        self._order, self._pos, self._run, self._trace, self._step = None, 0, None, None, 0
        self._features = self.features  # the episode's schedule (reset's options may set its budget)

    # ---- trace stream ----

    def next_trace(self) -> int:
        """Index of the next trace of the (per-epoch shuffled) stream."""
        if self._order is None or self._pos >= len(self._order):
            n = len(self.traces)
            self._order = (self.np_random.permutation(n) if self.shuffle else np.arange(n)).tolist()
            self._pos = 0
        self._pos += 1
        return self._order[self._pos - 1]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "order": self._order, "pos": self._pos}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._order, self._pos, self._run = state["order"], state["pos"], None

    # ---- MDP ----

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[EvictionObs | None, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self._order, self._pos = None, 0
        index = (options or {}).get("trace")
        index = self.next_trace() if index is None else int(index)
        self._trace = self.traces[index]
        self._features = self._episode_features((options or {}).get("budget"), index)
        self._run = ChunkedPass(self.model, torch.tensor(self._trace.ids), self._trace.prompt_len, self._features)
        self._step = 0
        self._states = None
        return self._observe(self._run.advance()), {"trace": index}

    def _episode_features(self, budget: int | None, index: int) -> LearnedScorer:
        """The schedule of an episode on trace ``index``: ``budget`` tokens (None: the env's)."""
        if budget is None:
            return self.features
        budget, f = int(budget), self.features
        length = len(self.traces[index].ids)
        if not f.window + f.sink + 1 <= budget < length - f.interval:
            raise ValueError(
                f"options budget={budget} on trace {index} ({length} tokens): an episode's budget must be at "
                f"least window + sink + 1 = {f.window + f.sink + 1} and below the trace's length − interval = "
                f"{length - f.interval}, or nothing is evicted; pass a budget in that range"
            )
        return f.at_budget(budget)

    def _observe(self, due: bool) -> EvictionObs | None:
        if not due:
            return None
        features = self._features
        feats, states = zip(*(features.features(o) for o in self._run.observations()))
        self._states = states
        key_pos = torch.stack([layer.key_pos for layer in self._run.cache.layers])
        valid = key_pos >= 0
        candidates = valid & ~features.always_kept(key_pos)
        n_evict = (valid.sum(-1) - min(features.budget, key_pos.shape[-1])).clamp(min=0)
        x = torch.stack(feats).masked_fill(~valid[..., None], 0.0)
        return EvictionObs(x, key_pos, candidates, n_evict, self._step, features.budget)

    def step(self, action: Tensor) -> tuple[EvictionObs | None, float, bool, bool, dict]:
        """action: keep-slot indices [layers, 1, H, K] (sink and window slots among them)."""
        if self._run is None or self._states is None:
            raise RuntimeError("call reset() before step(), and stop once an episode terminated")
        action = torch.as_tensor(action)
        k = min(self._features.budget, self._run.cache.layers[0].key_pos.shape[-1])
        if action.shape != (len(self._states), 1, self.features.kv_heads, k):
            raise ValueError(f"action must be keep indices [layers, 1, kv_heads, {k}], got {tuple(action.shape)}")
        for layer, (keep, state) in enumerate(zip(action, self._states)):
            kept = self._run.cache.layers[layer].key_pos.gather(-1, keep)
            protected = self.features.always_kept(self._run.cache.layers[layer].key_pos)
            if bool((kept < 0).any()) or int(protected.sum()) != int(
                torch.zeros_like(protected).scatter_(-1, keep, True).logical_and(protected).sum()
            ):
                raise ValueError(f"layer {layer}: the action must keep valid slots including every sink/window slot")
            self._run.apply(layer, keep, state)
        self._step += 1
        self._states = None
        if self._run.advance():
            return self._observe(True), 0.0, False, False, {}
        loss, _ = self._run.scores()
        full, entropy = torch.tensor(self._trace.loss), torch.tensor(self._trace.entropy)
        penalty, hurt = hurt_penalty(loss, full, entropy, self.eta, self.low_entropy)
        info = {
            "penalty": penalty,
            "hurt": hurt,
            "loss_sum": float(loss.sum()),
            "full_loss_sum": float(full.sum()),
            "loss_ratio": float(loss.sum() / full.sum().clamp(min=1e-30)),
            "budget": self._features.budget,
        }
        self._run = None
        return None, -penalty, True, False, info

    def sample_action(self, obs: EvictionObs, rng: np.random.Generator) -> Tensor:
        """A uniformly random valid action (for :func:`kvrl.envs.check_env`)."""
        noise = torch.from_numpy(rng.random(obs.key_pos.shape))
        keep_score = torch.where(obs.candidates, noise, torch.where(obs.key_pos >= 0, 2.0, -1.0))
        k = min(obs.budget, obs.key_pos.shape[-1])
        keep = keep_score.topk(k, dim=-1).indices
        return keep.gather(-1, obs.key_pos.gather(-1, keep).argsort(dim=-1, stable=True))
