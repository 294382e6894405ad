"""G-KV Distill: pull the sparse-cache model's next-token distribution onto the full cache's.

Seed 003 Appendix C ("Distillation-like training with sparse attention mask"), for tasks
without a verifiable reward. Sequences are sampled, the G-KV eviction that decoding them
performs is recorded, and the student π_θ' (initialised as π_θ) is trained under that
sparse attention with Hinton's soft-target loss against the frozen full-cache teacher π_θ:

    L = T² · Σ_{i,t} KL( softmax(z_teacher,t / T) ‖ softmax(z_student,t / T) ) / N

over the generated tokens t of every sample i, N = the whole step's normaliser
(``rl.aggregation``: tokens, or per-sample means over samples, as the GRPO core), so
data-parallel learners sum to the whole batch's gradient.

One deviation, said plainly: the paper samples the sequences from the full-cache teacher
and *simulates* the eviction afterwards; here the rollout workers sample them from the
current student decoding under G-KV (the trace is then the real eviction, not a
simulation, and at step 0 the student is the teacher). Rewards are still computed and
logged by the loop, but the loss ignores them.

Both distributions come from ``HFEngine.score(..., distributions=True)``: the student's
under the replayed trace, the teacher's under full attention. The student is scored at
the sampling temperature (so the learner's train/inference mismatch check still holds)
and re-tempered to T: ``log_softmax(lp_s · t_s / T) = log_softmax(z / T)`` exactly.
"""

from __future__ import annotations

import copy

import torch

from kvrl.algos.rl_sparse import RLSparse
from kvrl.engines.hf import HFEngine


class Distill(RLSparse):
    """Distill (G-KV, arXiv 2512.00504, Appendix C): G-KV rollouts and traces as RL-Sparse; the loss is
    T²·KL(full-cache teacher ‖ sparse student) over the generated tokens' [V] distributions."""

    learns_from_rewards = False  # the loss is the teacher's, whatever the rewards
    advantages_only = False

    def __init__(self, cfg):
        super().__init__(cfg)  # the G-KV rollout policy; the rules (rl.kl_coef=0 too) are distill_config.py's
        self.T = cfg.distill.temperature
        self.teacher = None  # the frozen full-cache model, on learners

    def setup(self, model, tokenizer) -> list[torch.nn.Parameter]:
        # the initial weights, taken before a checkpoint is loaded into `model`
        self.teacher = HFEngine(copy.deepcopy(model).eval().requires_grad_(False), tokenizer)
        return list(model.parameters())

    def loss(self, engine, batch):
        if batch.trace is None:
            raise ValueError(
                "distill got samples without an eviction trace: the rollout engine must "
                "decode under rollout_policy() and return its traces"
            )
        scores = engine.score(
            batch.sequences, batch.prompt_lens, trace=batch.trace, temperature=self.temperature, distributions=True
        )
        with torch.no_grad():
            teacher = self.teacher.score(
                batch.sequences, batch.prompt_lens, temperature=self.T, distributions=True
            ).distributions  # [B, G, V], full cache
        student = torch.log_softmax(scores.distributions * (self.temperature / self.T), -1)
        mask = scores.mask.to(student.dtype)
        kl = (teacher.exp() * (teacher - student)).sum(-1) * mask  # [B, G]
        if self.rl.aggregation == "token":
            total = kl.sum()
        else:
            total = (kl.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        loss = self.T**2 * total / max(float(batch.num_items), 1.0)
        tokens = int(mask.sum())
        metrics = {"kl": (kl.sum() / max(tokens, 1)).item(), "tokens": tokens}
        return loss, scores, metrics
