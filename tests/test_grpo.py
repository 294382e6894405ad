"""The shared GRPO core against a hand computation and against TRL 1.16's own loss code."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from kvrl.algos.grpo import group_advantages, grpo_loss, mask_truncated, segment_advantages

EPS = 1e-4  # TRL's advantage epsilon (grpo_trainer.py:2787)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0])
    a = group_advantages(rewards, 4)
    s1 = math.sqrt(4 * 0.25 / 3)  # Bessel-corrected std of [1,0,0,1]
    s3 = math.sqrt((3 * 0.0625 + 0.5625) / 3)  # of [1,1,1,0]
    want = [
        0.5 / (s1 + EPS),
        -0.5 / (s1 + EPS),
        -0.5 / (s1 + EPS),
        0.5 / (s1 + EPS),
        0,
        0,
        0,
        0,  # zero-std group -> exactly 0
        0.25 / (s3 + EPS),
        0.25 / (s3 + EPS),
        0.25 / (s3 + EPS),
        -0.75 / (s3 + EPS),
    ]
    assert a.tolist() == pytest.approx(want, abs=1e-6)
    assert (a[4:8] == 0).all()
    assert group_advantages(rewards, 4, scale="none").tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0.25, 0.25, 0.25, -0.75]
    )
    # ties that are not exact zeros in float arithmetic still give exactly 0
    assert (group_advantages(torch.full((3,), 0.1), 3) == 0).all()


def test_group_advantages_equal_trl():
    """TRL's advantage code (grpo_trainer.py:2765-2787, sum_then_normalize, scale_rewards
    group/none) reproduced line by line with its own nanstd."""
    torch.manual_seed(0)
    G = 8
    rewards = torch.randint(0, 3, (5 * G,)).float() / 2
    rewards[:G] = 1.0  # one zero-std group
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    trl_group = (rewards - mean) / (std + 1e-4)
    trl_none = rewards - mean
    assert torch.allclose(group_advantages(rewards, G), trl_group, atol=1e-6)
    assert torch.allclose(group_advantages(rewards, G, scale="none"), trl_none, atol=1e-6)


def test_mask_truncated():
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    trunc = torch.tensor([True, True, False, False])
    assert mask_truncated(adv, trunc, "zero").tolist() == [0.0, 0.0, 0.5, -0.5]
    assert mask_truncated(adv, trunc, "clip").tolist() == [1.0, 0.0, 0.5, -0.5]  # G-KV: clamp(A, min=0)
    assert mask_truncated(adv, trunc, "keep").tolist() == adv.tolist()


def test_segment_advantages_by_hand():
    # one group of 3 samples with 2 segments: segment 0 right for samples 0 and 1, segment 1 for sample 2 only
    sequence = torch.tensor([0.5, -0.25, 1.0])
    segments = [[0, 0, 1, -1], [0, 1, 1], [-1, 0, 1, 1, -1]]
    credits = [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    per_token = segment_advantages(sequence, segments, credits, 3)
    a0 = group_advantages(torch.tensor([1.0, 1.0, 0.0]), 3)  # segment 0's rewards over the group
    a1 = group_advantages(torch.tensor([0.0, 0.0, 1.0]), 3)
    want = [
        [a0[0], a0[0], a1[0], 0.5],  # a token of no segment: its sample's sequence advantage
        [a0[1], a1[1], a1[1]],
        [1.0, a0[2], a1[2], a1[2], 1.0],
    ]
    assert [len(t) for t in per_token] == [len(w) for w in want]
    for got, w in zip(per_token, want):
        assert got.tolist() == pytest.approx([float(x) for x in w])
    # a segment every sample gets right (or wrong) carries no signal: its tokens' advantages are exactly 0
    same = segment_advantages(torch.zeros(2), [[0, 1], [0, 1]], [[1.0, 0.0], [1.0, 1.0]], 2)
    assert same[0][0] == 0.0 and same[1][0] == 0.0 and same[0][1] < 0 < same[1][1]
    with pytest.raises(ValueError, match="same segments"):
        segment_advantages(torch.zeros(2), [[0], [0]], [[1.0], [1.0, 0.0]], 2)
    with pytest.raises(ValueError, match="segment 2 of 2"):
        segment_advantages(torch.zeros(2), [[2], [0]], [[1.0, 0.0], [0.0, 1.0]], 2)


def test_loss_with_per_token_advantages_is_the_sequence_loss_when_they_agree():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]])
    logp = (old + torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 1.0]]).log()).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    for aggregation in ("token", "sequence"):
        seq, _ = grpo_loss(logp, old, adv, mask, aggregation=aggregation)
        tok, _ = grpo_loss(logp, old, adv[:, None].expand(2, 3), mask, aggregation=aggregation)
        assert tok.item() == pytest.approx(seq.item())
    # a token's own advantage: only seq 1's last token is credited (A=3), the others 0
    loss, _ = grpo_loss(logp, old, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 3.0]]), mask)
    loss.backward()
    assert logp.grad[0].abs().sum() == 0 and logp.grad[1, :2].abs().sum() == 0
    assert logp.grad[1, 2].item() == pytest.approx(-3.0 * 1.0 / 5)


def test_loss_by_hand():
    # two sequences of 2 and 3 tokens; ratios chosen so that the clip is active on some
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]])
    ratios = torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 1.0]])
    logp = (old + ratios.log()).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    # per token: -min(ρA, clip(ρ,0.8,1.2)A)
    # seq 0 (A=2):  ρ=1.5 -> -min(3.0, 2.4) = -2.4 ; ρ=0.9 -> -min(1.8, 1.8) = -1.8
    # seq 1 (A=-1): ρ=0.5 -> -min(-0.5,-0.8) = 0.8 ; ρ=1.1 -> 1.1 ; ρ=1.0 -> 1.0
    per_tok = [[-2.4, -1.8], [0.8, 1.1, 1.0]]
    loss, m = grpo_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(sum(map(sum, per_tok)) / 5)
    loss_seq, _ = grpo_loss(logp, old, adv, mask, aggregation="sequence")
    assert loss_seq.item() == pytest.approx((sum(per_tok[0]) / 2 + sum(per_tok[1]) / 3) / 2)
    # clip active: seq 0 token 0 (ρ>1.2, A>0) and seq 1 token 0 (ρ<0.8, A<0)
    assert m["clip_high"] == pytest.approx(1 / 5) and m["clip_low"] == pytest.approx(1 / 5)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["ratio_max"] == pytest.approx(1.5) and m["ratio_min"] == pytest.approx(0.5)
    assert m["tokens"] == 5
    # gradient: zero where clipped, -A·ρ/N (d/dlogp of -ρA) elsewhere
    loss.backward()
    want = torch.tensor([[0.0, -2 * 0.9, 0.0], [0.0, 1.1, 1.0]]) / 5
    assert torch.allclose(logp.grad, want, atol=1e-6)
    # an explicit normaliser: the same sum divided by the whole batch's count
    half, _ = grpo_loss(logp[:1], old[:1], adv[:1], mask[:1], num_items=5)
    assert half.item() == pytest.approx(sum(per_tok[0]) / 5)


def test_kl_term_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    loss, m = grpo_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logprobs=ref, beta=0.1)
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]  # d = ref - logp
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2)
    assert m["kl"] == pytest.approx(sum(k3) / 2)


# ---- TRL's own loss ----------------------------------------------------------------------


class _Accelerator:
    """The parts of accelerate's Accelerator that GRPOTrainer._compute_loss touches, for one process."""

    num_processes = 1
    sync_gradients = True

    def reduce(self, t, reduction="sum"):
        return t

    def gather(self, t):
        return t

    gather_for_metrics = gather


def trl_loss(loss_type, logp, old, adv, mask, ref=None, beta=0.0, eps_low=0.2, eps_high=0.28):
    """Run TRL 1.16's ``GRPOTrainer._compute_loss`` (grpo_trainer.py:3020-3291) unmodified on a
    stand-in trainer whose model forward returns ``logp``: the loss lines are 3079-3119
    (ratio, k3 KL, two-sided clip) and 3152-3174 ("grpo": per-sequence mean, then mean;
    "dapo": Σ over tokens / num_items_in_batch)."""
    B, T = logp.shape
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        loss_type=loss_type,
        beta=beta,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        importance_sampling_level="token",
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        current_gradient_accumulation_steps=1,
        _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type,aggregation", [("dapo", "token"), ("grpo", "sequence")])
def test_loss_equals_trl(loss_type, aggregation, beta):
    torch.manual_seed(1)
    B, T = 6, 9
    old = -torch.rand(B, T) * 3
    logp0 = old + torch.randn(B, T) * 0.3  # ratios spread over both clip edges
    ref = old + torch.randn(B, T) * 0.2
    lengths = torch.tensor([9, 3, 5, 9, 1, 7])
    mask = (torch.arange(T) < lengths[:, None]).float()
    adv = group_advantages(torch.tensor([1.0, 0, 0, 1, 1, 0]), 3)
    ours_lp = logp0.clone().requires_grad_()
    theirs_lp = logp0.clone().requires_grad_()
    ours, m = grpo_loss(
        ours_lp, old, adv, mask, eps_low=0.2, eps_high=0.28, ref_logprobs=ref, beta=beta, aggregation=aggregation
    )
    theirs, tm = trl_loss(loss_type, theirs_lp, old, adv, mask, ref=ref if beta else None, beta=beta)
    assert torch.allclose(ours, theirs, atol=1e-6), (ours.item(), theirs.item())
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_lp.grad, theirs_lp.grad, atol=1e-7)
    assert 0 < m["clip_frac"] < 1
    assert m["clip_low"] == pytest.approx(tm["clip_ratio/low_mean"][0])
    assert m["clip_high"] == pytest.approx(tm["clip_ratio/high_mean"][0])
    assert m["clip_frac"] == pytest.approx(tm["clip_ratio/region_mean"][0])
    if beta:
        assert m["kl"] == pytest.approx(tm["kl"][0])


def test_bad_options_name_the_choices():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="token"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), aggregation="seq")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), beta=0.1)
