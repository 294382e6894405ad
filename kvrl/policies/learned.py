"""ForesightKV's learned scorer: a per-KV-head MLP over keys, values and attention features."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvrl.kernels.scores import window_attention
from kvrl.policies.base import KVPolicy, Observation

HIDDEN = 16  # ForesightKV's SelectionModel hidden width
DECAY = 0.9  # ForesightKV's decayed-cumsum factor
N_FEATURES = 8  # attention features per query head


class ScorerMLP(nn.Module):
    """Per-layer, per-KV-head MLP ``[k ‖ v ‖ features] → 16 → GELU → 1`` with biases.

    Weights are batched over (layer, head) and applied with einsum (ForesightKV's
    ``HeadWiseLinear``; its declared LayerNorm is unused, so there is none here).
    Initialised like ``nn.Linear``: U(±1/√fan_in) for weights and biases.

    Parameters
    ----------
    layers, kv_heads, in_features : int
    generator : torch.Generator
    """

    def __init__(self, layers: int, kv_heads: int, in_features: int, generator: torch.Generator):
        super().__init__()

        def uniform(*shape, fan_in):
            bound = 1 / math.sqrt(fan_in)
            return nn.Parameter((torch.rand(*shape, generator=generator) * 2 - 1) * bound)

        self.w1 = uniform(layers, kv_heads, in_features, HIDDEN, fan_in=in_features)
        self.b1 = uniform(layers, kv_heads, HIDDEN, fan_in=in_features)
        self.w2 = uniform(layers, kv_heads, HIDDEN, fan_in=HIDDEN)
        self.b2 = uniform(layers, kv_heads, fan_in=HIDDEN)

    def forward(self, layer: int, x: Tensor) -> Tensor:
        """x [B, H, N, F] → eviction score [B, H, N] (higher = drop)."""
        h = F.gelu(torch.einsum("bhnf,hfo->bhno", x, self.w1[layer]) + self.b1[layer][:, None])
        return torch.einsum("bhno,ho->bhn", h, self.w2[layer]) + self.b2[layer][:, None]


@dataclass(kw_only=True)
class LearnedScorer(KVPolicy):
    """ForesightKV's learned scorer (RUCAIBox/ForesightKV; methods.md §4).

    Features per query head g of the KV head's group, over the step's queries (the last
    ``interval``, ``observe = interval``), with attention = softmax per query head over all
    visible keys, in ForesightKV's concatenation order (8·G features):
    max, min (over the valid queries), sum, sum of the last 16, of the last 8, of the last
    32 queries, cumulative sum, 0.9-decayed cumulative sum. The last two are per-token state
    (``state_size = 2·G``: [cumsum for g=0..G−1, decayed for g=0..G−1]), NaN → 0, updated as
    ``c ← c + sum`` and ``d ← 0.9·d + sum`` before use. (ForesightKV's evaluation code
    overwrites the decayed sum with the plain one after the first step, methods.md §4; its
    training code — and this — decays correctly.)

    The scorer :class:`ScorerMLP` maps ``[k ‖ v ‖ features]`` (2·head_dim + 8·G) to an
    *eviction* score, higher = drop, like ForesightKV's; kvrl's keep-score is its negative,
    so ``select(sample=True)`` evicts by ``softmax(eviction score)``. Gradients flow to the
    scorer (features and K/V are inputs only).

    Parameters
    ----------
    group : int
        G, query heads per KV head.
    head_dim, layers, kv_heads : int
        Model geometry; the scorer holds one MLP per (layer, KV head).
    seed : int, default 0
        Seeds the scorer's initialisation.
    window : int, default 128
        ForesightKV always keeps the newest chunk (128 tokens at evaluation).
    interval : int, default 128
        ForesightKV's evaluation compresses every 128 tokens (256 in training).

    Attributes
    ----------
    scorer : ScorerMLP
        Built in ``__post_init__`` on the CPU in float32; load trained weights with
        ``scorer.load_state_dict`` and move it with ``scorer.to(device)``.
    """

    group: int
    head_dim: int
    layers: int
    kv_heads: int
    seed: int = 0
    window: int = 128
    scorer: ScorerMLP = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        for name in ("group", "head_dim", "layers", "kv_heads"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value}: must be ≥ 1 (read it from the model config)")
        self.state_size = 2 * self.group  # per instance: depends on the model's GQA group
        in_features = 2 * self.head_dim + N_FEATURES * self.group
        self.scorer = ScorerMLP(self.layers, self.kv_heads, in_features,
                                torch.Generator().manual_seed(self.seed))

    @property
    def observe(self) -> int:
        return self.interval

    def score(self, obs: Observation) -> tuple[Tensor, Tensor]:
        """Keep-scores [B, H, N] (= −eviction score) and state [B, H, N, 2G]."""
        b, hq, w, d = obs.queries.shape
        h, n, g = obs.keys.shape[1], obs.keys.shape[2], self.group
        if hq != h * g:
            raise ValueError(f"queries have {hq} heads but kv_heads·group = {h}·{g}; check `group`")
        # Per-query-head attention: fold the group into the query axis (g-major), so the
        # "pool" over a group of one is the identity.
        attn = window_attention(obs.queries.reshape(b, h, g * w, d), obs.keys, obs.key_pos,
                                obs.query_pos.repeat(1, g), obs.scaling).view(b, h, g, w, n)
        qvalid = (obs.query_pos >= 0)[:, None, None, :, None]
        total = attn.sum(3)
        state = self.previous_state(obs).nan_to_num(0.0)
        cum = state[..., :g] + total.transpose(-1, -2)
        decayed = DECAY * state[..., g:] + total.transpose(-1, -2)
        low = attn.masked_fill(~qvalid, float("inf")).amin(3)
        low = low.masked_fill(low.isinf(), 0.0)  # a row without any valid query
        feats = [attn.amax(3), low, total,
                 attn[:, :, :, -16:].sum(3), attn[:, :, :, -8:].sum(3), attn[:, :, :, -32:].sum(3)]
        feats = [f.transpose(-1, -2) for f in feats]  # [B, H, N, G] each
        x = torch.cat([obs.keys.float(), obs.values.float(), *feats, cum, decayed], -1)
        evict = self.scorer(obs.layer, x.to(self.scorer.w1.dtype))
        return -evict.float(), torch.cat([cum, decayed], -1)
