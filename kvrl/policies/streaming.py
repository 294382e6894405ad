"""StreamingLLM: attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kvrl.policies.base import KVPolicy, Observation


@dataclass(kw_only=True)
class StreamingLLM(KVPolicy):
    """StreamingLLM (Xiao et al. 2023, https://arxiv.org/abs/2309.17453).

    Keeps the first ``sink`` tokens (the attention sinks) and the most recent
    ``budget − sink`` tokens: the keep-score is the true position, so top-k over the
    candidates takes the newest ones. Stateless; reads no queries.

    Parameters
    ----------
    budget, interval, window : see :class:`KVPolicy`
    sink : int, default 4
        The paper's (and R-KV's ``first_tokens``) 4 sink tokens.
    """

    sink: int = 4
    reads: ClassVar[frozenset[str]] = frozenset()

    def score(self, obs: Observation) -> tuple[Tensor, None]:
        """Keep-score = true position, [B, H, N] float32."""
        return obs.key_pos.float(), None
