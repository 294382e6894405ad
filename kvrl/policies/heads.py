"""Head allocation: which KV heads keep the full cache and which keep sink + recent only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(kw_only=True)
class HeadAllocation:
    """RLKV / DuoAttention head allocation (methods.md §3).

    Heads are ranked by their gate α (or any importance score, higher = more important)
    **globally** across layers, as DuoAttention's and RLKV's quantile threshold does; the
    ``round(s·L·H)`` lowest become compressed (sink + recent) heads, the rest keep the full
    cache. Unlike the quantile (plus U(0, 1e-6) noise to break ties), the count is exact
    and ties are broken deterministically: among equal gates, the lower flat index
    ``layer·H + head`` is compressed first. ``round`` is round-half-up. Gates are not
    clipped to [0, 1] (the learner already clamps them), so clipping cannot create ties.

    Parameters
    ----------
    gates : Tensor [layers, kv_heads] (or anything ``torch.as_tensor`` accepts)
    sparsity : float
        s in [0, 1], the fraction of heads compressed.
    layers, kv_heads : int
        The model's geometry; ``gates`` must have this shape.
    sink : int, default 16
    recent : int, default 64
        RLKV's evaluation setting (16 sink + 64 recent).
    """

    gates: Tensor
    sparsity: float
    layers: int
    kv_heads: int
    sink: int = 16
    recent: int = 64

    def __post_init__(self):
        self.gates = torch.as_tensor(self.gates)
        if tuple(self.gates.shape) != (self.layers, self.kv_heads):
            raise ValueError(f"gates has shape {tuple(self.gates.shape)}, expected (layers, kv_heads) = "
                             f"{(self.layers, self.kv_heads)}: pass one gate per (layer, KV head)")
        if not 0.0 <= self.sparsity <= 1.0:
            raise ValueError(f"sparsity={self.sparsity}: must be in [0, 1] (fraction of heads compressed)")
        if self.sink < 0:
            raise ValueError(f"sink={self.sink}: must be ≥ 0")
        if self.recent < 1:
            raise ValueError(f"recent={self.recent}: must be ≥ 1 (a token must see itself)")

    def compressed_mask(self) -> Tensor:
        """Bool [layers, kv_heads]: True for the round(s·L·H) compressed heads."""
        total = self.layers * self.kv_heads
        count = int(self.sparsity * total + 0.5)
        order = torch.sort(self.gates.flatten().double(), stable=True).indices
        mask = torch.zeros(total, dtype=torch.bool, device=self.gates.device)
        mask[order[:count]] = True
        return mask.view(self.layers, self.kv_heads)

    def death(self, length: int) -> Tensor:
        """Int32 [layers, kv_heads, length] eviction trace (``kvrl.kernels.replay``).

        Full heads: ``NEVER``. Compressed heads: key k < sink is never evicted; key
        k ≥ sink dies at ``k + recent``, so it is seen by the queries k … k+recent−1.
        """
        # Imported here: kvrl.kernels.replay registers with transformers on import, which
        # would make `import kvrl.policies` pay for importing transformers.
        from kvrl.kernels.replay import NEVER

        k = torch.arange(length, dtype=torch.int64, device=self.gates.device)
        window = torch.where(k < self.sink, NEVER, (k + self.recent).clamp(max=NEVER))
        return torch.where(self.compressed_mask()[..., None], window, NEVER).to(torch.int32)
