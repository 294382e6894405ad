"""Replay attention: attention restricted by an eviction trace (torch reference).

An eviction trace gives, per (layer, KV head, key position k), ``death[k]``: the first
query position that no longer sees key k (a large sentinel when never evicted). Query q
sees key k iff ``0 <= k <= q < death[k]`` — masking a key is exactly equivalent to
evicting it, so one full-sequence forward under the trace reproduces what an evicting
decoder computed. Sink+recent windows are ``death[k] = k + recent`` for ``k >= sink``.

Registered with transformers' attention interface as ``"kvrl_replay"``; the model call
passes ``kvrl_replay=Replay(...)`` as a keyword argument, which transformers forwards to
the attention function. This reference builds a boolean [B, H, Q, K] mask per layer; the
flex-attention / Triton versions must match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NEVER = torch.iinfo(torch.int32).max  # death of a key that is never evicted


@dataclass
class Replay:
    """What the attention needs to replay a trace.

    death:   [layers, B, H_kv, T] int, indexed by true key position.
    key_pos: [B, S] int, true position of the key in each cache slot (-1 = padding).
    """

    death: torch.Tensor
    key_pos: torch.Tensor


def visibility(death_slots: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """Boolean [B, H, Q, K]: which key slots each query sees.

    death_slots: [B, H, K] death time of the key in each slot; key_pos: [B, K] (-1 = pad);
    query_pos: [B, Q] true positions of the queries.
    """
    k = key_pos[:, None, None, :]
    q = query_pos[:, None, :, None]
    return (k >= 0) & (k <= q) & (q < death_slots[:, :, None, :])


def replay_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0,
                     position_ids=None, kvrl_replay: Replay | None = None, **kwargs):
    """transformers attention function: query [B, Hq, Q, D], key/value [B, Hkv, K, D]
    -> (out [B, Q, Hq, D], None)."""
    if kvrl_replay is None:
        raise ValueError("attn_implementation='kvrl_replay' needs model(..., kvrl_replay=Replay(...))")
    n_keys = key.shape[2]
    key_pos = kvrl_replay.key_pos[:, :n_keys]
    death = kvrl_replay.death[module.layer_idx]  # [B, Hkv, T]
    death_slots = death.gather(-1, key_pos.clamp(min=0)[:, None, :].expand(-1, death.shape[1], -1))
    allowed = visibility(death_slots, key_pos, position_ids)
    # Padding queries see nothing; give them their whole row so softmax stays finite (their
    # outputs are never read, but a NaN value would poison real rows through 0 * NaN).
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed.repeat_interleave(groups, dim=1), scale=scaling,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("kvrl_replay", replay_attention)
