"""The shared GRPO core: group-normalised advantages and the clipped policy-gradient loss.

Every kvrl algorithm that learns from rewards (RL-Full, G-KV RL-Sparse, RLKV's gates,
ForesightKV stage 2) calls these functions; the algorithms differ only in what the
logprobs are *of* (generated tokens, or eviction actions) and in what else they add to
the loss. The formulas are TRL 1.16's (``GRPOTrainer``), checked numerically against
its own code in ``tests/test_grpo.py``:

    A_i     = (r_i − mean_g r) / (std_g r + eps)        per group g of G samples of one task;
                                                        std with Bessel's correction (TRL's nanstd)
    ρ_t     = exp(logp_t − logp_old_t)                  logp_old: the behaviour policy's logprob
    loss_t  = −min(ρ_t·A, clip(ρ_t, 1−ε_low, 1+ε_high)·A) + β·KL_t
    KL_t    = exp(ref_t − logp_t) − (ref_t − logp_t) − 1   (the k3 estimator of KL(π‖π_ref))

    aggregation "token"    (DAPO, TRL loss_type="dapo"): Σ_{i,t} loss_it / num_items,
                           num_items = the number of tokens in the whole batch
    aggregation "sequence" (GRPO paper, TRL loss_type="grpo"): mean_i (Σ_t loss_it / T_i)

``num_items`` is passed explicitly when a batch is split across learners or micro-batches:
each part divides its sum by the count of the *whole* batch, so summing the parts' gradients
gives exactly the gradient of the whole batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALES = ("group", "none")
TRUNCATED = ("zero", "clip", "keep")
AGGREGATIONS = ("token", "sequence")


def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """[N·G] rewards, the G samples of each task adjacent (task-major) -> [N·G] advantages.

    scale="group" divides by the group's std (GRPO); "none" only subtracts the mean
    (Dr. GRPO: the std division over-weights groups that are almost all right or wrong).
    A group whose rewards are all equal carries no signal: its advantages are exactly 0
    (without the explicit zero, rounding in the mean would leave ~1e-13 / eps residues).
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"need group_size >= 2 dividing {rewards.numel()} rewards, got {group_size}")
    r = rewards.double().view(-1, group_size)  # float64: rewards are few, and exact ties stay exact
    std = r.std(1, keepdim=True)  # unbiased, as TRL's nanstd (tests/test_grpo.py checks against it)
    adv = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = adv / (std + eps)
    adv = adv.masked_fill(r.eq(r[:, :1]).all(1, keepdim=True), 0.0)
    return adv.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def segment_advantages(
    sequence: Tensor, segments: list[list[int]], credits: list[list[float]], group_size: int, *, scale: str = "group"
) -> list[Tensor]:
    """Per-token advantages from per-segment rewards (``rl.credit=segment``).

    ``sequence`` [N·G]: the samples' sequence advantages (:func:`group_advantages` of their rewards), task-major.
    ``segments[i]`` [T_i]: the segment each of sample i's generated tokens belongs to (−1: none);
    ``credits[i]`` [K]: the reward of each of its K segments (every sample of a group has the same K: the
    segments are the task's, e.g. its queries). Segment k's rewards over a group are normalised as
    :func:`group_advantages` normalises a group's rewards; a token of segment k gets its sample's segment-k
    advantage, a token of no segment its sample's sequence advantage. Returns [T_i] float tensors.
    """
    out = []
    for g in range(0, len(segments), group_size):
        rows = credits[g : g + group_size]
        if len({len(r) for r in rows}) != 1:
            raise ValueError(
                f"the samples of one group must have the same segments, got counts {[len(r) for r in rows]}"
            )
        K = len(rows[0])
        # [G, K] -> K groups of G (segment-major), normalised like a group's rewards
        adv = group_advantages(torch.tensor(rows, dtype=torch.float64).T.reshape(-1), group_size, scale=scale)
        adv = adv.view(K, group_size).T if K else torch.zeros(group_size, 1, dtype=torch.float64)
        for j in range(group_size):
            seg = torch.tensor(segments[g + j], dtype=torch.long)
            if seg.numel() and int(seg.max()) >= K:
                raise ValueError(f"sample {g + j} names segment {int(seg.max())} of {K}")
            token = torch.where(seg >= 0, adv[j, seg.clamp(min=0)], sequence[g + j].double())
            out.append(token.to(sequence.dtype))
    return out


def mask_truncated(advantages: Tensor, truncated: Tensor, mode: str = "zero") -> Tensor:
    """Advantages of samples cut off at max_new_tokens (finish reason "length").

    A truncated sample's reward says little about its text (the answer never came):
    "zero" gives it advantage 0; "clip" is the G-KV reference's
    ``--clip_overlength_advantage`` (``experience_maker.compute_advantages``:
    ``clamp(A, min=0)``), so a reasoning cut short is never pushed down but can still be
    reinforced; "keep" is plain GRPO (the reference without that flag).
    """
    if mode == "zero":
        return advantages.masked_fill(truncated, 0.0)
    if mode == "clip":
        return torch.where(truncated, advantages.clamp(min=0.0), advantages)
    if mode == "keep":
        return advantages
    raise ValueError(f"mode must be one of {TRUNCATED}, got {mode!r}")


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.0,
    aggregation: str = "token",
    num_items: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped surrogate loss and its metrics.

    logprobs [B, T] (differentiable, the current policy), old_logprobs [B, T] (behaviour
    policy, no grad), advantages [B] (or [B, T]: per token), mask [B, T] (1 on the sample's tokens). ref_logprobs
    [B, T] is needed when beta > 0. num_items: the normaliser (tokens for "token", sequences
    for "sequence") of the whole batch this part belongs to; default: this part's own.

    Metrics (plain floats, means over this part's tokens unless named otherwise):
    ``clip_low`` / ``clip_high`` / ``clip_frac`` — fraction of tokens where the clip is
    active (ratio below 1−ε_low with A<0, above 1+ε_high with A>0, either), ``ratio_mean``,
    ``ratio_min``, ``ratio_max``, ``kl`` (when beta > 0), ``tokens`` (this part's count).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    mask = mask.to(logprobs.dtype)
    old_logprobs = old_logprobs.to(logprobs.dtype).detach()
    A = advantages.to(logprobs.dtype)
    A = A[:, None] if A.dim() == 1 else A  # a sample's advantage, or each token's (rl.credit=segment)

    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * A, clipped * A)
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs (the reference policy's logprobs)")
        d = ref_logprobs.detach() - logprobs
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl

    if aggregation == "token":
        n = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=mask.dtype)
        loss = (per_token * mask).sum() / n.clamp(min=1.0)
    else:
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        n = mask.new_tensor(float(mask.shape[0] if num_items is None else num_items))
        loss = per_seq.sum() / n.clamp(min=1.0)

    with torch.no_grad():
        on = mask.bool()
        tokens = int(on.sum())
        low = ((ratio < 1 - eps_low) & (A < 0))[on].float()
        high = ((ratio > 1 + eps_high) & (A > 0))[on].float()
        r = ratio[on] if tokens else ratio.new_ones(1)
        metrics = {
            "clip_low": low.mean().item() if tokens else 0.0,
            "clip_high": high.mean().item() if tokens else 0.0,
            "clip_frac": (low + high).mean().item() if tokens else 0.0,
            "ratio_mean": r.mean().item(),
            "ratio_min": r.min().item(),
            "ratio_max": r.max().item(),
            "tokens": tokens,
        }
        if beta != 0.0:
            metrics["kl"] = kl[on].mean().item() if tokens else 0.0
    return loss, metrics
