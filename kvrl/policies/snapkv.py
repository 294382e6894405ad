"""SnapKV applied at decode time: pooled attention of the observation window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kvrl.kernels import attention_received, pool_slots
from kvrl.policies.base import KVPolicy, Observation


@dataclass(kw_only=True)
class SnapKV(KVPolicy):
    """SnapKV (Li et al. 2024, https://arxiv.org/abs/2404.14469), re-applied every interval.

    As in ``snapkv/monkeypatch/snapkv_utils.py`` (FasterDecoding/SnapKV @395b54d): the last
    ``window`` queries attend over all keys (softmax including the window, causal), the
    window's own columns are dropped, the probabilities are summed over the queries and
    smoothed with ``avg_pool1d(kernel_size, padding=kernel_size // 2, stride=1)`` (zero
    padding counted, the PyTorch default). The original repeats K/V per query head and so
    never pools over GQA groups; kvrl caches per KV head and takes the group mean, as
    kvpress's ``SnapKVPress`` does (https://github.com/FasterDecoding/SnapKV/issues/22). Sum, mean and the average pool are
    linear, so their order does not matter. The pool runs over the candidate slots only
    (:func:`kvrl.kernels.reference.scores.pool_slots`), like the reference's pool over
    ``[:-window]``. Stateless.

    Parameters
    ----------
    window : int, default 32
        ``init_snapkv``'s default observation window.
    kernel_size : int, default 5
        ``init_snapkv``'s default (odd).
    """

    window: int = 32
    kernel_size: int = 5
    reads: ClassVar[frozenset[str]] = frozenset({"keys", "queries"})

    def __post_init__(self):
        super().__post_init__()
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size}: must be odd and ≥ 1 (1 = no pooling)")

    def score(self, obs: Observation) -> tuple[Tensor, None]:
        """Keep-scores [B, H, N]: pooled window attention of the candidates."""
        attn = attention_received(obs.queries, obs.keys, obs.key_pos, obs.query_pos, obs.scaling, gqa="mean")
        candidates = (obs.key_pos >= 0) & ~self.always_kept(obs.key_pos)
        return pool_slots(attn, candidates, self.kernel_size, "avg"), None
