"""H2O: heavy hitters by accumulated attention, plus recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kvrl.kernels import attention_received
from kvrl.policies.base import KVPolicy, Observation


@dataclass(kw_only=True)
class H2O(KVPolicy):
    """H2O (Zhang et al. 2023, https://arxiv.org/abs/2306.14048).

    Per-token state (S = 1): the attention each token has received, accumulated over
    evictions. At each eviction the observation is the last ``interval`` queries
    (``observe = interval``): with causal masking by true position, each of them sees
    exactly the cache it attended to when it was decoded, so the sum is exactly the
    attention paid since the last eviction. Attention is a softmax over all visible keys
    per query head, meaned over the GQA group (H2O targets MHA models; the mean keeps the
    scale of one head), summed over the queries and added to the state (NaN → 0).
    Keep-score = the accumulated state.

    Caveat: attention is only counted at evictions, so queries decoded before the cache
    first exceeded the budget (prompt tokens older than the last ``interval``, early
    generated tokens) are not accumulated; in steady state every interval evicts and
    nothing is lost. The paper splits the budget evenly between heavy hitters and recent
    tokens: set ``window = budget // 2`` for that recipe.
    """

    state_size: ClassVar[int] = 1
    reads: ClassVar[frozenset[str]] = frozenset({"keys", "queries"})

    @property
    def observe(self) -> int:
        return self.interval

    def score(self, obs: Observation) -> tuple[Tensor, Tensor]:
        """Keep-scores [B, H, N] and state [B, H, N, 1], the accumulated attention."""
        attn = attention_received(obs.queries, obs.keys, obs.key_pos, obs.query_pos, obs.scaling, gqa="mean")
        acc = self.previous_state(obs)[..., 0].nan_to_num(0.0) + attn
        return acc, acc[..., None]
