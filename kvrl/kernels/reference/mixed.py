"""RLKV's mixed-gate attention: ``α·full + (1−α)·(sink+recent)`` per KV head (torch reference).

RLKV trains one gate α ∈ [0, 1] per (layer, KV head) and, during its rollouts, each head
attends with the gate-weighted mix of two attentions over the same cache: the full causal
attention and the sink+recent (streaming) attention, where a query at position q sees key k
iff ``k ≤ q`` and (``k < sink`` or ``q < k + recent``) — exactly what
:meth:`kvrl.policies.HeadAllocation.death` gives a compressed head. Every engine path
(the HF engine's decode and score, the vLLM plugin) calls :func:`mixed_gate_attention`, so
their outputs agree to rounding. The gates and the window are the cache regime
:class:`kvrl.policies.Mixed`; this module takes them as a tensor and two ints.

``"kvrl_mixed"`` is registered with transformers' attention interface. The model call
passes ``kvrl_mixed=`` an object with ``gates`` [layers, kv_heads], ``sink`` and ``recent``
(a :class:`kvrl.policies.Mixed`) and explicit ``position_ids``; two uses:

* decoding an un-padded batch (one prompt, or prompts of equal length) with a plain
  ``DynamicCache``: key slot i holds position i;
* RLKV's learner (:meth:`kvrl.engines.hf.HFEngine.score`): one forward over a left-padded
  batch, with ``kvrl_key_pos`` [B, S] the true position of every key slot (−1 = padding)
  and ``position_ids`` clamped to ≥ 0 (a padding query then sees position 0 only, so
  its row stays finite and no NaN reaches the real tokens through the values).

The HF engine's own decode loop (``generate(policy=Mixed(...))``) calls
:func:`mixed_gate_attention` from the compacting cache's attention function
(:func:`kvrl.cache.evict_attention`) with the cache's per-head key positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface


def mixed_gate_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    query_pos: Tensor,
    key_pos: Tensor,
    gates: Tensor,
    *,
    sink: int,
    recent: int,
    scaling: float,
) -> Tensor:
    """Per KV head ``α·softmax-attention(causal) + (1−α)·softmax-attention(sink+recent)``.

    Parameters
    ----------
    query : Tensor [B, Hq, Q, D]
        Post-RoPE queries; query head h·G+g belongs to KV head h.
    key, value : Tensor [B, H, N, D]
    query_pos : Tensor [B, Q] int
        True positions (every query must see at least itself).
    key_pos : Tensor [B, N] or [B, H, N] int
        True positions of the key slots, −1 for empty slots.
    gates : Tensor [H] or [B, H]
        α per KV head.
    sink, recent : int
        The window of the compressed branch.
    scaling : float

    Returns
    -------
    Tensor [B, Hq, Q, D] in the dtype of ``query``.
    """
    b, hq, _, _ = query.shape
    h = key.shape[1]
    k = (key_pos[:, None] if key_pos.dim() == 2 else key_pos)[:, :, None, :]  # [B, H|1, 1, N]
    q = query_pos[:, None, :, None]  # [B, 1, Q, 1]
    causal = (k >= 0) & (k <= q)
    window = causal & ((k < sink) | (q < k + recent))
    group = hq // h

    def attend(mask):
        # One key_pos for all heads gives a [B, 1, Q, N] mask that broadcasts over the query
        # heads; repeating it to [B, Hq, Q, N] (as this did) held Hq masks of Q x N per branch
        # and layer through the learner's backward (12.7 GiB at rlkv_r1_llama_8b's shape).
        if mask.shape[1] != 1:  # per-KV-head positions: one mask per query head
            mask = mask.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)

    dt = torch.promote_types(query.dtype, torch.float32)  # the mix in float32, float64 for a float64 model
    alpha = gates.to(query.device, dt)
    alpha = (alpha[None] if alpha.dim() == 1 else alpha).expand(b, h).repeat_interleave(group, dim=1)
    alpha = alpha[:, :, None, None]
    out = alpha * attend(causal).to(dt) + (1 - alpha) * attend(window).to(dt)
    return out.to(query.dtype)


def mixed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    scaling,
    dropout=0.0,
    position_ids=None,
    kvrl_mixed=None,
    kvrl_key_pos: Tensor | None = None,
    **kwargs,
):
    """transformers attention function ``"kvrl_mixed"``: query [B, Hq, Q, D], key/value
    [B, H, N, D] (the whole cache) -> (out [B, Q, Hq, D], None). ``kvrl_mixed``: gates
    [layers, kv_heads], sink and recent (:class:`kvrl.policies.Mixed`). ``kvrl_key_pos``
    [B, N]: true key positions (−1 = padding); default: slot i holds position i (un-padded)."""
    if kvrl_mixed is None or position_ids is None:
        raise ValueError(
            "attn_implementation='kvrl_mixed' needs model(..., position_ids=..., kvrl_mixed=kvrl.policies.Mixed(...))"
        )
    n = key.shape[2]
    if kvrl_key_pos is None:
        key_pos = torch.arange(n, device=key.device).expand(key.shape[0], n)
    elif tuple(kvrl_key_pos.shape) != (key.shape[0], n):
        raise ValueError(
            f"kvrl_key_pos has shape {tuple(kvrl_key_pos.shape)}, the keys are {(key.shape[0], n)}: "
            "pass the true position of every key slot (a full-sequence forward, no cache)"
        )
    else:
        key_pos = kvrl_key_pos
    out = mixed_gate_attention(
        query,
        key,
        value,
        position_ids,
        key_pos,
        kvrl_mixed.gates[module.layer_idx],
        sink=kvrl_mixed.sink,
        recent=kvrl_mixed.recent,
        scaling=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("kvrl_mixed", mixed_attention)
