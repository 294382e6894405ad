"""Replay attention: attention restricted by an eviction trace.

An eviction trace gives, per (layer, KV head, key position k), ``death[k]``: the first
query position that no longer sees key k (a large sentinel when never evicted). Query q
sees key k iff ``0 <= k <= q < death[k]`` — masking a key is exactly equivalent to
evicting it, so one full-sequence forward under the trace reproduces what an evicting
decoder computed. Sink+recent windows are ``death[k] = k + recent`` for ``k >= sink``.

Registered with transformers' attention interface as ``"kvrl_replay"``; the model call
passes ``kvrl_replay=Replay(...)`` as a keyword argument, which transformers forwards to
the attention function. Two paths compute the same thing:

* the torch reference (default) builds a boolean [B, H, Q, K] mask per layer and calls
  SDPA; it also serves decoding with a cache (Q != K);
* ``Replay(..., flex=True)`` builds a flex-attention ``BlockMask`` per layer from a
  ``mask_mod`` that reads ``death`` and ``key_pos`` (:func:`replay_block_mask`), so no
  T×T tensor exists on GPU, where both the block mask and the attention are compiled.
  On CPU it runs eagerly — flex_attention's eager path materialises the scores, so it is
  the reference again, only checked to agree. Full-sequence forwards only (no cache).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface

from kvrl.kernels.reference import NEVER  # noqa: F401 (re-exported: the death of a key that is never evicted)


@dataclass
class Replay:
    """What the attention needs to replay a trace.

    death:   [layers, B, H_kv, T] int, indexed by true key position.
    key_pos: [B, S] int, true position of the key in each cache slot (-1 = padding).
    flex:    use flex_attention with a per-layer BlockMask (full-sequence forwards only).
    """

    death: torch.Tensor
    key_pos: torch.Tensor
    flex: bool = False
    block_masks: dict = field(default_factory=dict, repr=False)  # layer -> BlockMask, built once

    def block_mask(self, layer: int, groups: int) -> BlockMask:
        if layer not in self.block_masks:
            self.block_masks[layer] = replay_block_mask(self.death[layer], self.key_pos, groups)
        return self.block_masks[layer]


def visibility(death_slots: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """Boolean [B, H, Q, K]: which key slots each query sees.

    death_slots: [B, H, K] death time of the key in each slot; key_pos: [B, K] or
    [B, H, K] (-1 = pad); query_pos: [B, Q] true positions of the queries.
    """
    k = (key_pos[:, None] if key_pos.dim() == 2 else key_pos)[:, :, None, :]
    q = query_pos[:, None, :, None]
    return (k >= 0) & (k <= q) & (q < death_slots[:, :, None, :])


def replay_block_mask(death: torch.Tensor, key_pos: torch.Tensor, groups: int, block_size: int = 128) -> BlockMask:
    """flex-attention BlockMask of one layer's trace for a full-sequence forward.

    death: [B, H_kv, T] int (one layer); key_pos: [B, S] true positions of the sequence
    slots (-1 = padding), which are both the queries and the keys; groups: query heads
    per KV head (query head h reads KV head h // groups, as transformers' ``repeat_kv``).
    The mask_mod reads ``death`` re-indexed by slot, O(B·H·S) integers; nothing is T×T
    (on CPU ``create_block_mask`` is not compiled and evaluates the mask densely).
    """
    B, H, _ = death.shape
    S = key_pos.shape[1]
    death_slots = death.gather(-1, key_pos.clamp(min=0)[:, None, :].expand(-1, H, -1))  # [B, H, S]

    def mask_mod(b, h, q_idx, kv_idx):
        k, q = key_pos[b, kv_idx], key_pos[b, q_idx]
        return (k >= 0) & (k <= q) & (q < death_slots[b, h // groups, kv_idx])

    return create_block_mask(
        mask_mod, B, H * groups, S, S, device=key_pos.device, BLOCK_SIZE=block_size, _compile=key_pos.is_cuda
    )


_compiled_flex = None


def _flex(query, key, value, block_mask, scale):
    """Compiled flex_attention on GPU; eager on CPU (a dense reference there)."""
    global _compiled_flex
    if query.is_cuda:
        _compiled_flex = _compiled_flex or torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)


def replay_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    scaling,
    dropout=0.0,
    position_ids=None,
    kvrl_replay: Replay | None = None,
    **kwargs,
):
    """transformers attention function: query [B, Hq, Q, D], key/value [B, Hkv, K, D]
    -> (out [B, Q, Hq, D], None)."""
    if kvrl_replay is None and kwargs.get("kvrl_mixed") is not None:
        # RLKV's learner: mixed gates under the same implementation, so a checkpointed layer's
        # recompute in backward (after score() returned) runs the attention its forward ran
        from kvrl.kernels.reference.mixed import mixed_attention

        return mixed_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            position_ids=position_ids,
            **kwargs,
        )
    if kvrl_replay is None:
        raise ValueError(
            "attn_implementation='kvrl_replay' needs model(..., kvrl_replay=Replay(...)) (or kvrl_mixed=Mixed(...)). "
            "kvrl's HFEngine.score leaves a model on it after a gradient-checkpointed training forward (its "
            "backward recomputes under it), and KVGRPOTrainer keeps its model on it; to call the model plainly, "
            "set its attention back first: model.set_attn_implementation('sdpa') (or the one it had)"
        )
    groups = query.shape[1] // key.shape[1]
    if kvrl_replay.flex:
        if not query.shape[2] == key.shape[2] == kvrl_replay.key_pos.shape[1]:
            raise ValueError("Replay(flex=True) replays full-sequence forwards only (no KV cache)")
        # Padding query rows see nothing; flex returns 0 for them (no NaN).
        out = _flex(query, key, value, kvrl_replay.block_mask(module.layer_idx, groups), scaling)
        return out.transpose(1, 2).contiguous(), None
    n_keys = key.shape[2]
    key_pos = kvrl_replay.key_pos[:, :n_keys]
    death = kvrl_replay.death[module.layer_idx]  # [B, Hkv, T]
    death_slots = death.gather(-1, key_pos.clamp(min=0)[:, None, :].expand(-1, death.shape[1], -1))
    allowed = visibility(death_slots, key_pos, position_ids)
    # Padding queries see nothing; give them their whole row so softmax stays finite (their
    # outputs are never read, but a NaN value would poison real rows through 0 * NaN).
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed.repeat_interleave(groups, dim=1), scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("kvrl_replay", replay_attention)
