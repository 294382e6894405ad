"""R-KV: importance from the observation window minus key redundancy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kvrl.kernels.scores import attention_received, key_redundancy_update, pool_slots
from kvrl.policies.base import KVPolicy, Observation


def check_threshold(threshold: float) -> None:
    """The near-duplicate cosine threshold of R-KV and G-KV must lie in [0, 1]."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold={threshold}: must be in [0, 1] (a cosine; the references use 0.5)")


@dataclass(kw_only=True)
class RKV(KVPolicy):
    """R-KV (Cai et al. 2025, https://arxiv.org/abs/2505.24133), ``R1KV`` in Zefan-Cai/R-KV.

    ``score = λ·importance − (1−λ)·redundancy`` (methods.md §2 and §8):

    * importance: the query logits are max-pooled over the GQA group *before* one softmax
      over the candidate keys only (the window's own keys are out of the denominator),
      meaned over the observation queries, then ``max_pool1d(kernel_size, padding=k//2)``
      along the candidate slots (:func:`kvrl.kernels.scores.pool_slots`; the reference
      pools ``[:-window]``);
    * redundancy: :func:`kvrl.kernels.scores.key_redundancy` with ``threshold`` and
      ``retain_direction``, not normalised.

    State (S = 1): each valid slot's exempt row ("pick", the near-duplicate whose entry is
    zeroed) as a true position, −1 for none (NaN at invalid slots). It is only a cache:
    :func:`kvrl.kernels.scores.key_redundancy_update` reuses it at the next eviction to
    compare the new tokens and the tokens whose pick was evicted with the cache, instead of
    all N×N key pairs, and gives the same redundancy as without state.

    Departures from the reference, on purpose: every sample uses its own keys (the
    reference reads ``key_states[0]`` for the whole batch, issue #20); R-KV's column-0
    fallback (a row with no near-duplicate zeroes its cosine with token 0, ≤ 0.6 % of
    token 0's redundancy) is not reproduced — G-KV's padding-aware similarity (÷ valid
    length, eps 1e-6) is used, which equals R-KV's ÷ N without padding; caches stay in
    position order (the reference keeps them in score order, so its later pooling mixes
    score neighbours, not position neighbours); eviction follows :func:`should_evict`
    (R-KV also fires at N == budget, which only reorders).

    Parameters
    ----------
    mix_lambda : float, default 0.1
        λ. The class/CLI default is 0.07 but the README, SGLang and HF evaluations use 0.1,
        and the later vLLM port measured 0.07 losing accuracy at tight buffers.
    kernel_size : int, default 7
    window : int, default 8
    interval : int, default 128
    threshold : float, default 0.5
        Near-duplicate cosine threshold: ``cal_similarity(threshold=0.5)`` in R-KV's
        ``rkv/utils.py`` (``R1KV`` never passes it, so 0.5 is the only value the reference
        runs). In [0, 1]: below 0 the reference's zeroed diagonal would itself count as a
        near-duplicate; at 1 no pair qualifies (up to float rounding of exact copies), which
        leaves the plain mean cosine.
    retain_direction : {"last", "first"}, default "last"
        Which near-duplicate of each token does not count it: R-KV's ``retain_direction``
        (``R1KV(retain_direction=...)`` → ``cal_similarity``). ``"last"``: the most recent
        one, so the newest copy of a repeated key survives; ``"first"``: the earliest one,
        so the oldest copy survives. ``"first"`` follows the fixed version in R-KV's
        ``vLLM/rkv/algo.py`` (the original ``rkv/utils.py`` min-reduces over 0s and so
        nearly always exempts slot 0). See :func:`kvrl.kernels.scores.key_redundancy`.
        The ``*_percent`` directions (with ``retain_ratio``) are not implemented.
    """

    mix_lambda: float = 0.1
    kernel_size: int = 7
    threshold: float = 0.5
    retain_direction: str = "last"
    state_size: ClassVar[int] = 1
    reads: ClassVar[frozenset[str]] = frozenset({"keys", "queries"})

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda={self.mix_lambda}: must be in [0, 1]")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size}: must be odd and ≥ 1 (1 = no pooling)")
        check_threshold(self.threshold)
        if self.retain_direction not in ("last", "first"):
            raise ValueError(f"retain_direction={self.retain_direction!r}: must be 'last' or 'first'")

    def score(self, obs: Observation) -> tuple[Tensor, Tensor]:
        """Keep-scores [B, H, N] and state [B, H, N, 1] (the picks)."""
        attn = attention_received(obs.queries, obs.keys, obs.key_pos, obs.query_pos, obs.scaling,
                                  gqa="max", order="pool_then_softmax", candidates_only=True)
        valid = obs.key_pos >= 0
        candidates = valid & ~self.always_kept(obs.key_pos)
        n_queries = (obs.query_pos >= 0).sum(-1).clamp(min=1)[:, None, None]
        importance = pool_slots(attn / n_queries, candidates, self.kernel_size, "max")
        redundancy, pick = key_redundancy_update(obs.keys, obs.key_pos, self.previous_state(obs)[..., 0],
                                                 self.threshold, retain_direction=self.retain_direction)
        return self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy, pick[..., None]
