"""G-KV: a global score smoothed across evictions, minus key redundancy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvrl.kernels import attention_received, key_redundancy_update, pool_slots
from kvrl.policies.base import KVPolicy, Observation
from kvrl.policies.rkv import check_threshold

_MODES = ("max", "mean", "sum")


@dataclass(kw_only=True)
class GKV(KVPolicy):
    """G-KV (Liao et al. 2025, https://arxiv.org/abs/2512.00504; microsoft/G-KV@6db3b2e ``ScoreBasedKV``).

    Per eviction, per (batch, KV head), the candidates being the valid slots outside the sink and the last ``window``:

    1. local score S: softmax of each observation query over all visible keys (window
       included, causal), max over the GQA group, non-candidate columns dropped, mean over
       the queries; then ``S ÷ max_candidates S`` (with ``score_cache`` and ``normalise``);
    2. global score F from the previous F (state) with decay ``alpha`` (with ``score_cache``;
       else F = S): ``max``: ``max(α·F_old, S)``; ``mean``: ``α·F_old + (1−α)·S``; ``sum``
       (H2O mode): ``α·F_old + S``; a token without a stored F (NaN) takes ``F_old = S`` in
       max/mean, ``0`` in sum, as the reference;
    3. optional ``max_pool1d(F, kernel_size)`` over the candidates (``pool_slots``);
    4. redundancy R (:func:`kvrl.kernels.reference.scores.key_redundancy` with ``threshold``, the
       "last" direction) ÷ its max over candidates (with ``score_cache`` and ``normalise``);
    5. ``score = mix_lambda·F_pooled − (1−mix_lambda)·R``.

    The new state is [F, pick] (S = 2; F alone when ``mix_lambda == 1`` computes no R): F
    before pooling for every candidate, NaN for the always-kept slots (a window token starts
    from a fresh S as a candidate); the pick, each valid slot's exempt row of step 4 as a true
    position (−1: none), a cache that ``key_redundancy_update`` reuses for the same R.
    Defaults: the paper's "G-KV" recipe. The reference's knobs and what differs from it:
    ``docs/fidelity.md``.

    Parameters
    ----------
    mix_lambda : float, default 0.5
    alpha : float, default 0.8
        Memory decay rate α; 0 gives F = S.
    mode : {"max", "mean", "sum"}, default "max"
    kernel_size : int, default 0
        0 = no pooling; the reference's ``enable_pooling`` uses 5 (odd values only).
    threshold : float, default 0.5
        Near-duplicate cosine threshold, in [0, 1] (the reference runs 0.5 only).
    score_cache : bool, default True
        The reference's ``enable_score_cache``: True is G-KV (``S ÷ max S``, smoothing with the
        stored F, ``R ÷ max R``); False drops all three (``score = mix_lambda·pool(S) −
        (1 − mix_lambda)·R`` from this eviction alone, R from all N×N key pairs every time).
    normalise : bool, default True
        With ``score_cache``, divide S and R by their max over the candidates (G-KV, eq. 5).
    """

    window: int = 16
    mix_lambda: float = 0.5
    alpha: float = 0.8
    mode: str = "max"
    kernel_size: int = 0
    threshold: float = 0.5
    score_cache: bool = True
    normalise: bool = True
    state_size: ClassVar[int] = 2
    reads: ClassVar[frozenset[str]] = frozenset({"keys", "queries"})

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda={self.mix_lambda}: must be in [0, 1]")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha}: must be in [0, 1] (the paper recommends 0.8)")
        if self.mode not in _MODES:
            raise ValueError(f"mode={self.mode!r}: must be one of {_MODES}")
        if self.kernel_size < 0 or (self.kernel_size and self.kernel_size % 2 == 0):
            raise ValueError(f"kernel_size={self.kernel_size}: must be 0 (no pooling) or odd, e.g. 5")
        check_threshold(self.threshold)
        if self.mix_lambda == 1:
            self.state_size = 1  # per instance: no redundancy, so no picks to keep

    def score(self, obs: Observation) -> tuple[Tensor, Tensor]:
        """Keep-scores [B, H, N] and state [B, H, N, S]: F (NaN outside the candidates), the picks."""
        attn = attention_received(
            obs.queries, obs.keys, obs.key_pos, obs.query_pos, obs.scaling, gqa="max", order="softmax_then_pool"
        )
        valid = obs.key_pos >= 0
        candidates = valid & ~self.always_kept(obs.key_pos)
        tiny = torch.finfo(torch.float32).tiny  # guards a head whose candidates all have 0
        n_queries = (obs.query_pos >= 0).sum(-1).clamp(min=1)[:, None, None]
        local = attn / n_queries * candidates
        glob = local
        # Without the score cache nothing carries over between evictions, the picks included.
        nan = float("nan")
        previous = self.previous_state(obs) if self.score_cache else glob.new_full((*glob.shape, 2), nan)
        norm = self.score_cache and self.normalise  # the reference: enable_score_cache and not disable_norm
        if norm:
            local = local / local.amax(-1, keepdim=True).clamp(min=tiny)
        if self.score_cache:
            old = previous[..., 0]
            a = self.alpha
            if self.mode == "sum":
                glob = a * old.nan_to_num(0.0) + local
            else:
                old = torch.where(old.isnan(), local, old)
                glob = torch.maximum(a * old, local) if self.mode == "max" else a * old + (1 - a) * local
        pooled = pool_slots(glob, candidates, self.kernel_size, "max") if self.kernel_size else glob
        score = self.mix_lambda * pooled
        state = [glob.masked_fill(~candidates, nan)]
        if self.mix_lambda < 1:
            red, pick = key_redundancy_update(obs.keys, obs.key_pos, previous[..., 1], self.threshold)
            state.append(pick)
            red = red * candidates
            if norm:
                red = red / red.amax(-1, keepdim=True).clamp(min=tiny)
            score = score - (1 - self.mix_lambda) * red
        return score, torch.stack(state, -1)
