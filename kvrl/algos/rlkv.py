"""RLKV: RL-guided per-head gates (``rl.algo=rlkv``, trained by ``kvrl/jobs/rlkv.py``).

"Which Heads Matter for Reasoning? RL-Guided KV Cache Compression" (arXiv 2510.08525; reference
code Kurt232/RLKV@6dadf85, differences in docs/fidelity.md)::

    python -m kvrl.run recipe=tiny_rlkv        # train, then export gates + plots to output_dir

Contract:

* **Gates** α [layers, kv_heads], one raw scalar per (layer, KV head), init 1.0, no
  sigmoid: hard-clamped to [0, 1] before every update (the reference's
  ``clamp_adapter_weight``) and in what is pushed, so learner and rollouts hold the same
  values. The LLM is frozen; the optimizer holds only the gates.
* **Attention** of every head, in rollouts and in the learner, is
  ``α·full + (1−α)·(sink+recent)`` (:mod:`kvrl.kernels.reference.mixed`, one definition for both):
  rollouts run on the vLLM engine under the regime :class:`kvrl.policies.Mixed` with the
  gates pushed after every update (``Push(cache={"gates": ...})``), the learner recomputes
  logprobs with ``HFEngine.score(policy=Mixed)``; the loop logs the train/inference mismatch.
  The training window is ``rlkv.sink`` + ``rlkv.recent`` (exact windows; the reference
  trains with 128-token blocks and deploys exact windows).
* **Objective**: the GRPO core without KL plus the adaptive L1 penalty
  :func:`adaptive_penalty` on the mean reward r̄ of the learner's batch.
* **Export and deployment** (:mod:`kvrl.policies.heads`): ``gates.tsv`` and
  ``gates.safetensors`` with the head ranking; :func:`~kvrl.policies.heads.head_allocation`
  turns exported gates and a sparsity into the :class:`kvrl.policies.HeadAllocation` both
  engines deploy (top heads full, the rest ``rlkv.eval_sink`` + ``rlkv.eval_recent``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvrl.algos.base import Algorithm
from kvrl.algos.grpo import grpo_loss
from kvrl.algos.push import Push
from kvrl.policies import Mixed


def adaptive_penalty(gates: Tensor, mean_reward: float | Tensor, beta: float, tau: float) -> Tensor:
    """RLKV's adaptive L1 penalty (Eq. 4; ``areal/mixed_attn/loss.py``):

        𝟙(r̄ > τ) · β · (exp(r̄) − 1) · mean|α|

    gates [layers, kv_heads] (differentiable); mean_reward r̄: the raw mean reward of the
    batch (not the advantages). Zero — with zero gradient — while r̄ ≤ τ, so a policy whose
    reasoning broke down is no longer pushed further towards compression.
    """
    r = float(mean_reward)
    weight = beta * math.expm1(r) if r > tau else 0.0
    return weight * gates.abs().mean()


class RLKV(Algorithm):
    """The algorithm of ``rl.algo=rlkv``: gates α [layers, kv_heads] trained with GRPO
    (no KL) plus :func:`adaptive_penalty`; see the module docstring."""

    advantages_only = False  # the adaptive penalty trains the gates whatever the spread

    def __init__(self, cfg):
        super().__init__(cfg)  # its rules (vLLM, kv.policy=full, rl.kl_coef=0) are the config gate's: rlkv_config.py
        self.rl, self.rlkv, self.temperature = cfg.rl, cfg.rlkv, cfg.sampling.temperature
        self.gates: torch.nn.Parameter | None = None  # on learners, after setup()

    def mixed(self, gates: Tensor) -> Mixed:
        return Mixed(gates, sink=self.rlkv.sink, recent=self.rlkv.recent)

    def rollout_policy(self, model) -> Mixed:
        """Mixed-gate attention with every gate at its initial 1.0 (each push updates them)."""
        cfg = model.config  # the architecture only: rollout workers may hold a meta-device model
        return self.mixed(torch.ones(cfg.num_hidden_layers, cfg.num_key_value_heads))

    def setup(self, model, tokenizer) -> list[torch.nn.Parameter]:
        cfg = model.config
        # float32 whatever the model's dtype: Adam steps of 1e-2 on a bf16 value near 1 would round away
        self.gates = torch.nn.Parameter(torch.ones(cfg.num_hidden_layers, cfg.num_key_value_heads, device=model.device))
        return [self.gates]

    def loss(self, engine, batch):
        with torch.no_grad():  # the reference clamps before every micro-batch; no sigmoid
            self.gates.clamp_(0.0, 1.0)
        scores = engine.score(
            batch.sequences, batch.prompt_lens, policy=self.mixed(self.gates), temperature=self.temperature
        )
        rl = self.rl
        pg, metrics = grpo_loss(
            scores.logprobs,
            batch.old_logprobs,
            batch.advantages,
            scores.mask,
            eps_low=rl.eps_low,
            eps_high=rl.eps_high,
            aggregation=rl.aggregation,
            num_items=batch.num_items,
        )
        # r̄ of this learner's share: the reference's micro-batch mean (the whole step with one learner),
        # added once per share (on its first micro-batch)
        mean_reward = batch.rewards.float().mean().item()
        penalty = adaptive_penalty(self.gates, mean_reward, self.rlkv.l1_coef, self.rlkv.tau)
        penalty = penalty if batch.first else penalty * 0.0
        g = self.gates.detach()
        metrics.update(
            pg_loss=pg.item(),
            penalty=penalty.item(),
            gate_mean=g.mean().item(),
            gate_min=g.min().item(),
            gate_max=g.max().item(),
            **{f"gate/{l}.{h}": g[l, h].item() for l in range(g.shape[0]) for h in range(g.shape[1])},
        )
        return pg + penalty, scores, metrics

    def state(self, model) -> Push:
        """The gates, as the rollout regime's state (``Push(cache={"gates": ...})``)."""
        # clamped, so the rollouts' gates are the values the next loss() computes with
        return Push(cache={"gates": self.gates.detach().clamp(0.0, 1.0).cpu()})

    def load(self, model, state: Push) -> None:
        """Load :meth:`state`'s gates (a plain ``{"gates"}`` dict, as older checkpoints hold, loads too)."""
        with torch.no_grad():
            self.gates.copy_(state["gates"])
