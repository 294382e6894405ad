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
    """G-KV (Liao et al. 2025, microsoft/G-KV ``ScoreBasedKV``; methods.md §1 and §8).

    Per eviction, per (batch, KV head), with the candidates = valid slots outside the sink
    and the last ``window``:

    1. local score S: softmax of each observation query over all visible keys (window
       included, causal), max over the GQA group, non-candidate columns dropped, mean over
       the queries; then ``S ÷ max_candidates S`` (with ``score_cache`` and ``normalise``);
    2. global score F from the previous F (state, S = 1) with decay ``alpha`` (with
       ``score_cache`` only; without it F = S):
       ``max``: ``max(α·F_old, S)``; ``mean``: ``α·F_old + (1−α)·S``; ``sum`` (H2O mode):
       ``α·F_old + S``. Tokens without a stored F (NaN) use ``F_old = S`` in max/mean and
       ``0`` in sum, as the reference;
    3. optional ``max_pool1d(F, kernel_size)`` over the candidates (off by default;
       :func:`kvrl.kernels.reference.scores.pool_slots`);
    4. redundancy R (:func:`kvrl.kernels.reference.scores.key_redundancy` with ``threshold``, the
       "last" direction) ÷ its max over candidates (with ``score_cache`` and ``normalise``);
    5. ``score = mix_lambda·F_pooled − (1−mix_lambda)·R``.

    The new state is [F, pick] (S = 2; S = 1, F alone, when ``mix_lambda == 1`` computes
    no R). F is the pre-pooling F of every candidate; always-kept slots get NaN, like the
    reference, which stores F only for the kept candidates: the window tokens start from a
    fresh S when they become candidates. The pick is every valid slot's exempt row of step
    4 as a true position (−1: none), only a cache:
    :func:`kvrl.kernels.reference.scores.key_redundancy_update` reuses it at the next eviction
    instead of comparing all N×N key pairs, with the same R. Unlike the reference, finished rows and
    ``q_len != window`` need no special case (methods.md §8 quirks 5, 6).

    Defaults follow the paper's "G-KV" recipe (``scripts/inference.sh``): budget 2048,
    window 16, interval 128, mix_lambda 0.5, alpha 0.8, max smoothing, no pooling. The CLI
    defaults differ (window 64, mix_lambda 0.1). ``mix_lambda=1`` turns redundancy off.

    The reference's knobs (``ScoreBasedKV`` and ``gkv/inference_main.py``'s CLI, G-KV
    @345e290; issue #38's audit against 6db3b2e, every knob set to match: the same kept
    tokens in all 29 cases of R-KV and G-KV, G-KV's scores within 3.3e-7) and what is left
    different:

    ========================== ===================== =========================================
    G-KV                       kvrl                  remaining difference
    ========================== ===================== =========================================
    ``budget``                 ``budget``            none (G-KV @345e290 also runs a no-op
                                                     compression at N == budget)
    ``window_size``            ``window``            none
    ``divide_length``          ``interval``          none (:func:`should_evict`)
    ``mix_lambda``             ``mix_lambda``        none
    ``alpha``                  ``alpha``             none
    ``smooth_method``          ``mode``              none ("sum" is not on G-KV's CLI)
    ``enable_pooling``,        ``kernel_size``       none; 0 is off, 5 is ``enable_pooling``
    ``kernel_size`` 5
    ``suppressing_redundancy`` ``mix_lambda < 1``    none: off is ``mix_lambda=1`` (score = F)
    ``enable_score_cache``     ``score_cache``       none
    ``compress_mode="ratio"``, ``budget_ratio``      G-KV's length is its batch's padded
    ``compress_ratio``                               width, kvrl's each row's own: equal at
                                                     batch 1; a shorter row of a batch keeps
                                                     fewer tokens in kvrl (tests/test_policies.py
                                                     ::test_gkv_ratio_budget_counts_each_rows_own_length)
    similarity threshold 0.5   ``threshold``         none (hard-coded in the reference)
    Triton redundancy rule     "last"                the 6db3b2e kernel: equal within 3.7e-9
                                                     (issue #38); the 345e290 kernel: differs
                                                     for a token with two or more
                                                     near-duplicates (three copies: row sums
                                                     2, 1, 1 against 2, 1, 0); not measured on
                                                     real caches
    ``retain_direction``,      —                     stored, read by neither similarity path
    ``retain_ratio``                                 (``retain_ratio`` only by the raw one)
    ``disable_norm``           ``normalise=False``   none
    ``triton_similarity``      not expressed         ``cal_similarity_raw``: sample 0's keys
    False                                            for the whole batch, eps 1e-8, R-KV's
                                                     token-0 fallback, no padding mask; only
                                                     the class default switches it (not on the
                                                     CLI, no script); kvrl keeps one
                                                     per-sample, padding-aware similarity
                                                     (size not measured)
    finished rows              no special case       G-KV still compacts a finished row's K/V
                                                     but returns its old positions and score
                                                     cache, which no longer describe the keys;
                                                     kvrl keeps them consistent. Kept sets agree
                                                     (issue #38); expressing G-KV's would store
                                                     a state that is wrong by construction
    ``attention_shift_``       not expressed         CAKE's ``+ γ·std`` over the queries
    ``indicator``
    GQA ``pooling="max"``      max (fixed)           none
    padding at min − 1e-6      never a candidate     none: both evict padding first
    TF32 ``tl.dot`` on GPU     float32               ~1e-3 relative in the cosines can flip a
                                                     near-duplicate at 0.5 (not measured)
    ========================== ===================== =========================================

    Parameters
    ----------
    mix_lambda : float, default 0.5
    alpha : float, default 0.8
        Memory decay rate α; 0 gives F = S.
    mode : {"max", "mean", "sum"}, default "max"
    kernel_size : int, default 0
        0 = no pooling; the reference's ``enable_pooling`` uses 5 (odd values only).
    threshold : float, default 0.5
        Near-duplicate cosine threshold, in [0, 1]: ``cal_similarity_triton(threshold=0.5)``
        in ``gkv/utils/compression_score.py`` (``ScoreBasedKV`` never passes it, so 0.5 is
        the only value the reference runs). There is no ``retain_direction``: the reference
        stores one (``--retain_direction``) but passes it to neither similarity function.
        kvrl runs "last", the rule methods.md §8 and issue #38's audit give for G-KV's
        Triton kernel (@6db3b2e, equal within 3.7e-9); the kernel at @345e290 differs for a
        token with two or more near-duplicates (see the G-KV paragraph of
        :func:`kvrl.kernels.reference.scores.key_redundancy`).
    score_cache : bool, default True
        The reference's ``enable_score_cache`` (``ScoreBasedKV.update_kv``): True is G-KV
        (``S ÷ max S``, smoothing with the stored F, ``R ÷ max R``); False drops all three,
        as the reference's own "SnapKV" and "R-KV" recipes run (``scripts/inference.sh``):
        ``score = mix_lambda·pool(S) − (1 − mix_lambda)·R`` from this eviction alone, with S
        and R unnormalised. The state is still returned (F = S, and the picks) but never
        read, so R is computed from all N×N key pairs at every eviction. G-KV's
        R-KV recipe is ``GKV(score_cache=False, kernel_size=5, mix_lambda=0.1)``, its SnapKV
        recipe ``GKV(score_cache=False, kernel_size=5, mix_lambda=1.0)`` (``enable_pooling``
        uses ``ScoreBasedKV``'s kernel_size 5, which the CLI does not expose; the script runs
        every recipe with window 16).
    normalise : bool, default True
        With ``score_cache``, divide S and R by their max over the candidates (G-KV, eq. 5).
        False is the reference's ``disable_norm`` (on its CLI, in no script): F smooths the
        raw S, and R enters raw.
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
        attn = attention_received(obs.queries, obs.keys, obs.key_pos, obs.query_pos, obs.scaling,
                                  gqa="max", order="softmax_then_pool")
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
