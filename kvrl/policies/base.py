"""The KV-policy contract: what an engine hands a policy, and what the policy hands back.

A policy scores the tokens of a per-(layer, KV head) cache (:meth:`KVPolicy.score`, the
only method a policy writes) and :meth:`KVPolicy.select` turns the scores into the slots to
keep, deterministically or by sampling with the log-probability of the action. Engines
call both every ``interval`` generated tokens (:func:`should_evict`), then compact keys,
values, positions and state with :func:`kvrl.kernels.reference.scores.gather_slots`.

Shapes: B batch, H KV heads, Hq query heads, N cache slots, W observation queries,
D head dim, S per-token state size, K = min(max_b budget_at(L_b), N) kept slots, where L_b
is row b's true length (its newest cached position + 1; :meth:`KVPolicy.budget_at`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvrl.budget import least_budget


@dataclass
class Observation:
    """What an engine hands a policy at an eviction step, for one layer.

    Attributes
    ----------
    keys : Tensor [B, H, N, D]
        Post-RoPE cached keys in slot order: ascending true position among valid slots;
        invalid slots may sit anywhere.
    values : Tensor [B, H, N, D]
    queries : Tensor [B, Hq, W, D]
        The last W post-RoPE queries, W ≤ ``policy.observe`` (fewer right after a short
        prompt); query head h·G+g belongs to KV head h.

        Each of ``keys``, ``values`` and ``queries`` may be None when the policy's
        ``reads`` does not name it: the vLLM engine then skips copying it out of the cache.
    key_pos : Tensor [B, H, N] int
        True position of each slot, −1 for padding or empty slots.
    query_pos : Tensor [B, W] int
        True positions of the queries (−1 for a padding query).
    state : Tensor [B, H, N, S] or None
        Per-token policy state, compacted along with the cache. Slots whose tokens have no
        state yet hold NaN (the engine appends NaN for new tokens); each policy applies its
        own rule to them. None for policies with ``state_size == 0``.
    layer : int
        −1 when the rows come from several layers: the vLLM engine evicts a few layers in
        one call for a policy whose ``reads`` leaves out ``"layer"``.
    scaling : float
        Attention logit scale, 1/√D.
    """

    keys: Tensor
    values: Tensor
    queries: Tensor
    key_pos: Tensor
    query_pos: Tensor
    state: Tensor | None
    layer: int
    scaling: float


@dataclass
class Selection:
    """The slots a policy keeps.

    Attributes
    ----------
    keep : Tensor [B, H, K] int64
        Slot indices. ``keep[b, :, :count[b]]`` are what row b keeps, sorted ascending by
        true position (invalid slots, kept only when fewer than ``count[b]`` valid slots
        exist, first); ``keep[b, :, count[b]:]`` fill the row up to K and must be dropped.
    count : Tensor [B] int64
        Slots row b keeps: ``min(budget_at(L_b), N)``. Below K only in ratio mode, for a row
        shorter than the longest of its batch (its budget is smaller).
    logprob : Tensor [B, H] float32 or None
        Sampled selections only: log-probability of the ordered eviction draw ``evicted``.
    evicted : Tensor [B, H, E] int64 or None
        Sampled selections only: the evicted candidate slots in the order they were drawn,
        padded with −1 where a row evicted fewer than E. With the candidate mask this is
        what :func:`plackett_luce_logprob` needs to recompute ``logprob`` under new scores.
    """

    keep: Tensor
    count: Tensor
    logprob: Tensor | None = None
    evicted: Tensor | None = None


def budget_at(budget: int, ratio: float | None, length: int | Tensor) -> int | Tensor:
    """The one copy of the budget's arithmetic (:meth:`KVPolicy.budget_at`; the dry-run plan
    calls it before any policy exists): ``budget``, or ``max(budget, ⌊ratio·length⌋)``."""
    if isinstance(length, Tensor):
        if ratio is None:
            return torch.full_like(length, budget, dtype=torch.long)
        return (length.double() * ratio).floor().long().clamp(min=budget)
    return budget if ratio is None else max(budget, math.floor(length * ratio))


def geometry(config) -> dict[str, int]:
    """The attention shape of a transformers config: ``layers``, ``kv_heads``, ``group``
    (query heads per KV head) and ``head_dim``. Qwen2 (R1-Distill-Qwen) and older Llama
    configs carry no ``head_dim``: it is then ``hidden_size // num_attention_heads``, as
    in their attention modules."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "layers": config.num_hidden_layers,
        "kv_heads": config.num_key_value_heads,
        "group": config.num_attention_heads // config.num_key_value_heads,
        "head_dim": head_dim,
    }


def should_evict(
    generated: int | Tensor, cache_len: int | Tensor, policy: KVPolicy, length: int | Tensor
) -> bool | Tensor:
    """Whether the engine evicts after the forward that just wrote to the cache, which
    brought the sequence to true length ``length`` (prompt + generated tokens written);
    int64 tensors [R] of rows give a bool tensor [R].

    G-KV's rule (microsoft/G-KV@6db3b2e ``ScoreBasedKV``): evict when the number of generated tokens written to the
    cache is a multiple of ``interval`` — including 0, right after prefill — and the cache
    holds more than ``budget_at(length)`` entries. The cache then oscillates between the
    budget and budget + ``interval``, and a prompt longer than the budget is compressed
    right after prefill. (R-KV also compresses at ``cache_len == budget``, which only
    reorders.)
    """
    return (generated % policy.interval == 0) & (cache_len > policy.budget_at(length))


def plackett_luce_logprob(scores: Tensor, candidates: Tensor, evicted: Tensor) -> Tensor:
    """Log-probability of an ordered eviction draw.

    The draw takes slots one at a time without replacement from ``softmax(−scores)`` over
    the remaining candidates (Plackett–Luce): ``Σ_i [−s_{e_i} − logsumexp_{j ∉ e_<i} −s_j]``.

    Parameters
    ----------
    scores : Tensor [B, H, N]
        Keep-scores (higher = keep); differentiable.
    candidates : Tensor [B, H, N] bool
        Slots the draw could take.
    evicted : Tensor [B, H, E] int64
        Drawn slots in draw order, −1 padded.

    Returns
    -------
    Tensor [B, H] float32
    """
    x = (-scores.float()).masked_fill(~candidates, torch.finfo(torch.float32).min)
    n, e = x.shape[-1], evicted.shape[-1]
    drawn = evicted >= 0
    # Order each row as [drawn slots in draw order, everything else]; the i-th draw's
    # denominator is then the logsumexp over positions i.. of that order. Undrawn slots get
    # rank e; an extra column absorbs the scatter of the −1 padding.
    rank = torch.full((*x.shape[:-1], n + 1), e, dtype=torch.long, device=x.device)
    steps = torch.arange(e, device=x.device).expand_as(evicted)
    rank.scatter_(-1, torch.where(drawn, evicted, n), torch.where(drawn, steps, e))
    xs = x.gather(-1, rank[..., :n].argsort(dim=-1, stable=True))
    tail_lse = xs.flip(-1).logcumsumexp(-1).flip(-1)
    # Multiply rather than torch.where: x is finite, so masked terms carry no NaN gradient.
    return ((xs - tail_lse)[..., :e] * drawn).sum(-1)


def gumbel_noise(scores: Tensor, key_pos: Tensor, generator) -> Tensor:
    """Standard Gumbel noise [B, H, N] float32 for sampled selections.

    ``generator`` is one ``torch.Generator`` (or None) for the whole batch, or a list with
    one per batch row: row b then draws [H, n_b], n_b = its last valid slot + 1, so its
    noise does not depend on the rows it is batched with — the vLLM engine evicts the
    requests of a step together, each from its own seeded generator (0 at the padding).
    """
    if not isinstance(generator, (list, tuple)):
        return -torch.empty_like(scores, dtype=torch.float32).exponential_(generator=generator).log()
    idx = torch.arange(1, key_pos.shape[-1] + 1, device=key_pos.device)
    ends = ((key_pos >= 0).any(1) * idx).amax(-1).tolist()  # [B]
    out = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
    for b, (g, n) in enumerate(zip(generator, ends)):
        out[b, :, :n] = -torch.empty(scores.shape[1], n, device=scores.device).exponential_(generator=g).log()
    return out


@dataclass(kw_only=True)
class KVPolicy:
    """Base KV policy: budget, eviction schedule, protected tokens, and selection.

    Subclasses write only :meth:`score`. Caches stay in position order.

    Parameters
    ----------
    budget : int
        B, cache entries per KV head kept after an eviction (window and sink included, as
        G-KV's budget). Must be ≥ window + sink + 1. With ``budget_ratio`` it is the floor.
    interval : int, default 128
        L, evict every L generated tokens (:func:`should_evict`).
    window : int, default 8
        w, the last w valid tokens are always kept (and are the observation window of the
        attention-based policies).
    sink : int, default 0
        The first ``sink`` valid tokens are always kept.
    budget_ratio : float in (0, 1], optional
        G-KV's ratio mode (``--compress_mode ratio --compress_ratio R``): an eviction at
        true length L keeps ``max(budget, ⌊R·L⌋)`` entries (:meth:`budget_at`), a fraction of
        every token seen so far, prompt included. None: a fixed budget.
    """

    budget: int
    interval: int = 128
    window: int = 8
    sink: int = 0
    budget_ratio: float | None = None
    state_size: ClassVar[int] = 0
    # The Observation fields score() reads (engines may pass None, or −1 for the layer, for
    # the others): a policy that scores keys alone spares the engine half of each eviction's
    # copy out of the cache, and one that ignores the layer can be evicted layers at a time.
    reads: ClassVar[frozenset[str]] = frozenset({"keys", "values", "queries", "layer"})

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window={self.window}: must be ≥ 1 (the newest token is always kept)")
        if self.sink < 0:
            raise ValueError(f"sink={self.sink}: must be ≥ 0")
        if self.interval < 1:
            raise ValueError(f"interval={self.interval}: must be ≥ 1 (evict every `interval` tokens)")
        # a policy built in Python (make_policy, a user's script) is checked here; on the config path the
        # kv section checks kv.* by the same rule (kvrl.budget) before torch is imported (kvrl.config.shared.KVConfig)
        least = least_budget(self.window, self.sink)
        if self.budget < least:
            raise ValueError(
                f"budget={self.budget}: must be ≥ window + sink + 1 = {least} "
                f"so that at least one slot is chosen by score; raise budget or lower window/sink"
            )
        if self.budget_ratio is not None and not 0 < self.budget_ratio <= 1:
            raise ValueError(
                f"budget_ratio={self.budget_ratio}: must be in (0, 1] (the fraction of the tokens seen "
                "that an eviction keeps), or None for the fixed budget"
            )

    def budget_at(self, length: int | Tensor) -> int | Tensor:
        """Entries per KV head an eviction at true length ``length`` keeps (an int, or a
        Tensor [B] of lengths → [B] int64): ``budget``, or ``max(budget, ⌊budget_ratio·L⌋)``.

        G-KV ``ScoreBasedKV.update_kv`` (``gkv/model/compression/score_based.py`` @345e290,
        its ``compress_mode == "ratio"`` branch): ``budget = int(cur_len * compress_ratio) if
        budget / cur_len < compress_ratio else budget``, where ``cur_len`` (``gen_patch._sample``)
        is the sequence length after the forward that compresses, prompt included — the same
        value, from the same float64 product (0.29·100 gives 28, as there). The reference's
        ``cur_len`` is the padded width of its batch; here each row counts its own tokens, so
        a row's budget does not depend on what it is batched with (equal at batch size 1).
        """
        return budget_at(self.budget, self.budget_ratio, length)

    @property
    def observe(self) -> int:
        """Number of recent queries the policy needs in ``Observation.queries``."""
        return self.window

    def score(self, obs: Observation) -> tuple[Tensor, Tensor | None]:
        """Keep-scores [B, H, N] (higher = keep; any value at invalid slots) and the updated
        per-token state [B, H, N, S] (None when ``state_size == 0``)."""
        raise NotImplementedError

    def trainable(self) -> torch.nn.Module | None:
        """The module a learner trains and sends to rollout workers (the learned scorer's
        MLP); None for the hand-written policies (:meth:`kvrl.policies.Evicting.state`)."""
        return None

    def always_kept(self, key_pos: Tensor) -> Tensor:
        """Bool [B, H, N]: the first ``sink`` and the last ``window`` valid slots.

        Slot order is position order among valid slots, so the rank of a valid slot among
        the valid slots of its head is its rank by position.
        """
        valid = key_pos >= 0
        rank = valid.cumsum(-1) - 1
        count = valid.sum(-1, keepdim=True)
        return valid & ((rank < self.sink) | (rank >= count - self.window))

    def previous_state(self, obs: Observation) -> Tensor:
        """``obs.state``, or all-NaN ("no state yet") when the engine passed None."""
        if obs.state is not None:
            return obs.state
        return obs.key_pos.new_full((*obs.key_pos.shape, self.state_size), float("nan"), dtype=torch.float32)

    def select(
        self, obs: Observation, scores: Tensor, *, sample: bool = False, generator: torch.Generator | list | None = None
    ) -> Selection:
        """Choose ``count[b] = min(budget_at(L_b), N)`` slots per (batch row b, KV head),
        L_b = the row's newest cached position + 1 (the eviction follows the write of the
        newest token, which the window always keeps); K = the largest count.

        Always kept: the first ``sink`` and the last ``window`` valid slots. The rest is
        filled from the other valid slots (the candidates); invalid slots are kept only
        when fewer than ``count[b]`` valid slots exist. A row whose count is below K (ratio
        mode) is filled up to K with its next-best slots, which engines drop
        (:class:`Selection`).

        Deterministic (``sample=False``): ``torch.topk`` of the scores among candidates.
        Scores of candidates must be finite; among equal scores the choice is whatever
        ``torch.topk`` returns (unspecified but repeatable on one device).

        Sampled (``sample=True``): the E = (valid slots − K) evicted candidates are drawn
        sequentially without replacement from ``softmax(−scores)`` over the remaining
        candidates (Plackett–Luce), implemented as Gumbel-top-k: the E largest of
        ``−scores + Gumbel noise``. ``logprob`` is the log-probability of that *ordered*
        draw (:func:`plackett_luce_logprob`) — an exact, unbiased REINFORCE likelihood for
        the action "this ordered draw"; it is not the probability of the evicted *set*
        (which sums over all E! orders). ForesightKV instead samples among the top-2E and
        scores with a plain log-softmax, which is not the sampling probability
        (ForesightKV, arXiv 2602.03203).

        Parameters
        ----------
        obs : Observation
        scores : Tensor [B, H, N]
            From :meth:`score`.
        sample : bool
        generator : torch.Generator or list of them, optional
            Source of the Gumbel noise (on the scores' device); one per batch row in a list
            (:func:`gumbel_noise`).

        Returns
        -------
        Selection
        """
        key_pos = obs.key_pos
        valid = key_pos >= 0
        count = self.budget_at(key_pos.amax((-2, -1)) + 1).clamp(max=key_pos.shape[-1])  # [B]
        k = int(count.max()) if count.numel() else 0
        kept = self.always_kept(key_pos)
        candidates = valid & ~kept
        scores = scores.float()
        logprob = evicted = None
        priority = scores
        if sample:
            gumbel = gumbel_noise(scores, key_pos, generator)
            evict_key = torch.where(candidates, gumbel - scores.detach(), float("-inf"))
            n_evict = (valid.sum(-1) - count[:, None]).clamp(min=0)  # [B, H]
            order = evict_key.topk(int(n_evict.max()) if n_evict.numel() else 0, dim=-1).indices
            steps = torch.arange(order.shape[-1], device=order.device)
            evicted = order.masked_fill(steps >= n_evict[..., None], -1)
            logprob = plackett_luce_logprob(scores, candidates, evicted)
            priority = -evict_key  # kept candidates = those not among the E largest keys
        inf = torch.tensor(float("inf"), device=scores.device)
        priority = torch.where(kept, inf, torch.where(candidates, priority, -inf))
        if bool((count < k).any()):
            best = priority.topk(k, dim=-1).indices  # by priority: row b keeps its first count[b]
            keep, order = best.sort(-1)
            fill = (torch.arange(k, device=best.device) >= count.to(best.device)[:, None, None]).expand_as(best)
            fill = fill.gather(-1, order)
        else:
            # Every row keeps K: the complement of the N − K lowest priorities, read off a
            # mask in ascending slot order. At an eviction N − K (the interval) is far below
            # K, and this is 2–3x cheaper on a CPU than topk(K) and a sort.
            dropped = priority.topk(key_pos.shape[-1] - k, dim=-1, largest=False).indices
            mask = torch.ones(priority.shape, dtype=torch.bool, device=priority.device).scatter_(-1, dropped, False)
            keep, fill = mask.nonzero()[:, -1].view(*mask.shape[:-1], k), None
        # Valid slots are already in position order, so this is the order unless a row keeps
        # an invalid slot or a fill: then a stable sort by position moves the invalid ones
        # (position −1) to the front and the fill to the back.
        at = key_pos.gather(-1, keep)
        if fill is not None or bool((at < 0).any()):
            if fill is not None:
                at = at.masked_fill(fill, torch.iinfo(key_pos.dtype).max)
            keep = keep.gather(-1, at.argsort(dim=-1, stable=True))
        return Selection(keep=keep, count=count, logprob=logprob, evicted=evicted)
