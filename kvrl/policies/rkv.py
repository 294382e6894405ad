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
      along the candidate slots (``pool_slots``; the reference pools ``[:-window]``);
    * redundancy: ``key_redundancy`` with ``threshold`` and ``retain_direction``, not normalised.

    State (S = 1): each valid slot's exempt row ("pick", the near-duplicate whose entry is
    zeroed) as a true position, −1 for none (NaN at invalid slots); only a cache, which
    ``key_redundancy_update`` reuses at the next eviction for the same redundancy.

    Redundancy is G-KV's padding-aware form (÷ valid length), equal to R-KV's ÷ N without
    padding. The reference's knobs (``R1KV``, ``cal_similarity`` in Zefan-Cai/R-KV@d15c976)
    and what differs from them: ``docs/fidelity.md``.

    Parameters
    ----------
    mix_lambda : float, default 0.1
        λ, as R-KV's README and evaluations run it (its class and CLI default is 0.07).
    kernel_size : int, default 7
    window : int, default 8
    interval : int, default 128
    threshold : float, default 0.5
        Near-duplicate cosine threshold, in [0, 1] (the reference runs 0.5 only): below 0 the
        zeroed diagonal would itself count as a near-duplicate; at 1 no pair qualifies (up to
        float rounding of exact copies), which leaves the plain mean cosine.
    retain_direction : {"last", "first", "first_vllm"}, default "last"
        Which near-duplicate of each token does not count it (R-KV's ``retain_direction``):
        ``"last"`` the most recent (the newest copy of a repeated key survives; both R-KV
        versions); ``"first"`` the paper's code (``rkv/utils.py``), where token 0 alone looks
        unique; ``"first_vllm"`` the vLLM port's (``vLLM/rkv/algo.py``) earliest, so the
        oldest copy survives. See :func:`kvrl.kernels.reference.scores.key_redundancy`.
    fallback : bool, default False
        The reference's rule for a token with no near-duplicate: zero its cosine with the first
        valid slot (``"last"``) or the newest (``"first_vllm"``). ``fallback=True`` with
        ``mix_lambda=0.07`` is ``rkv/utils.py`` with ``run_math.py``'s λ.
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
