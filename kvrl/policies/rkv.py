"""R-KV: importance from the observation window minus key redundancy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kvrl.kernels import RETAIN_DIRECTIONS, attention_received, key_redundancy_update, pool_slots
from kvrl.policies.base import KVPolicy, Observation


def check_threshold(threshold: float) -> None:
    """The near-duplicate cosine threshold of R-KV and G-KV must lie in [0, 1]."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold={threshold}: must be in [0, 1] (a cosine; the references use 0.5)")


@dataclass(kw_only=True)
class RKV(KVPolicy):
    """R-KV (Cai et al. 2025, https://arxiv.org/abs/2505.24133), ``R1KV`` in Zefan-Cai/R-KV.

    ``score = λ·importance − (1−λ)·redundancy``:

    * importance: the query logits are max-pooled over the GQA group *before* one softmax
      over the candidate keys only (the window's own keys are out of the denominator),
      meaned over the observation queries, then ``max_pool1d(kernel_size, padding=k//2)``
      along the candidate slots (:func:`kvrl.kernels.reference.scores.pool_slots`; the reference
      pools ``[:-window]``);
    * redundancy: :func:`kvrl.kernels.reference.scores.key_redundancy` with ``threshold`` and
      ``retain_direction``, not normalised.

    State (S = 1): each valid slot's exempt row ("pick", the near-duplicate whose entry is
    zeroed) as a true position, −1 for none (NaN at invalid slots). It is only a cache:
    :func:`kvrl.kernels.reference.scores.key_redundancy_update` reuses it at the next eviction to
    compare the new tokens and the tokens whose pick was evicted with the cache, instead of
    all N×N key pairs, and gives the same redundancy as without state.

    The reference's knobs (``R1KV`` and ``cal_similarity`` in Zefan-Cai/R-KV@d15c976) and what
    differs from them: ``docs/fidelity.md``.

    Redundancy is G-KV's padding-aware form (÷ valid length), which equals R-KV's ÷ N
    without padding.

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
    retain_direction : {"last", "first", "first_vllm"}, default "last"
        Which near-duplicate of each token does not count it: R-KV's ``retain_direction``
        (``R1KV(retain_direction=...)`` → ``cal_similarity``). ``"last"``: the most recent
        one, so the newest copy of a repeated key survives (both R-KV versions). ``"first"``
        is the paper's code (``rkv/utils.py``): its min over indices that are j for a
        near-duplicate j and 0 elsewhere is 0 for every row, so every row's cosine with token 0
        is zeroed:
        token 0's redundancy counts nothing (it alone looks unique), every other token's counts
        all its cosines. ``"first_vllm"`` is R-KV's later
        vLLM port (``vLLM/rkv/algo.py``), which fixed that: the earliest near-duplicate, so
        the oldest copy survives. See :func:`kvrl.kernels.reference.scores.key_redundancy`.
    fallback : bool, default False
        Reproduce the reference's rule for a token with no near-duplicate: zero its cosine
        with token 0 (the first valid slot; ``"last"``) or with the newest slot
        (``"first_vllm"``, the port's clamp to N − 1). Off by default, as kvrl always ran;
        ``fallback=True`` with ``mix_lambda=0.07`` is ``rkv/utils.py`` with ``run_math.py``'s λ.
    """

    mix_lambda: float = 0.1
    kernel_size: int = 7
    threshold: float = 0.5
    retain_direction: str = "last"
    fallback: bool = False
    state_size: ClassVar[int] = 1
    reads: ClassVar[frozenset[str]] = frozenset({"keys", "queries"})

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda={self.mix_lambda}: must be in [0, 1]")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size}: must be odd and ≥ 1 (1 = no pooling)")
        check_threshold(self.threshold)
        if self.retain_direction not in RETAIN_DIRECTIONS:
            raise ValueError(
                f"retain_direction={self.retain_direction!r}: must be one of {RETAIN_DIRECTIONS} "
                "('first' is R-KV's rkv/utils.py, 'first_vllm' its vLLM port)"
            )

    def score(self, obs: Observation) -> tuple[Tensor, Tensor]:
        """Keep-scores [B, H, N] and state [B, H, N, 1] (the picks)."""
        attn = attention_received(
            obs.queries,
            obs.keys,
            obs.key_pos,
            obs.query_pos,
            obs.scaling,
            gqa="max",
            order="pool_then_softmax",
            candidates_only=True,
        )
        valid = obs.key_pos >= 0
        candidates = valid & ~self.always_kept(obs.key_pos)
        n_queries = (obs.query_pos >= 0).sum(-1).clamp(min=1)[:, None, None]
        importance = pool_slots(attn / n_queries, candidates, self.kernel_size, "max")
        redundancy, pick = key_redundancy_update(
            obs.keys,
            obs.key_pos,
            self.previous_state(obs)[..., 0],
            self.threshold,
            retain_direction=self.retain_direction,
            fallback=self.fallback,
        )
        return self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy, pick[..., None]
