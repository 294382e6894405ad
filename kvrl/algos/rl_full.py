"""RL-Full: GRPO fine-tuning of the whole model with the full KV cache (G-KV's baseline).

G-KV (arXiv 2512.00504) compares its sparse-cache training against this: the same GRPO, the same
rewards, but rollouts and learner both attend to every token. What the loop needs from it:

* rollouts run with the full cache (no KV policy, no eviction trace);
* every parameter is trainable;
* the loss is the shared GRPO core on logprobs recomputed by ``engine.score`` under full
  attention, at the sampling temperature (so they are the behaviour logprobs' equals);
  with ``rl.kl_coef > 0`` a frozen copy of the initial model gives the reference logprobs;
* the full state_dict is pushed to the rollout workers after each update (``Push(weights=...)``).
"""

from __future__ import annotations

import copy

import torch

from kvrl.algos.base import Algorithm
from kvrl.algos.grpo import grpo_loss
from kvrl.algos.push import Push
from kvrl.engines.hf import HFEngine
from kvrl.policies import Full


class RLFull(Algorithm):
    trains_weights = True  # and so do RL-Sparse and Distill, its subclasses

    def __init__(self, cfg):
        super().__init__(cfg)  # its rules (kv.policy=full) are the config gate's: rl_full_config.py
        self.rl, self.temperature = cfg.rl, cfg.sampling.temperature
        self.ref = None  # the reference engine, on learners when rl.kl_coef > 0

    def rollout_policy(self, model) -> Full:
        """The full cache."""
        return Full()

    def setup(self, model, tokenizer) -> list[torch.nn.Parameter]:
        if self.rl.kl_coef > 0:
            # the initial weights, taken before a checkpoint is loaded into `model`
            self.ref = HFEngine(copy.deepcopy(model).eval().requires_grad_(False), tokenizer)
        return list(model.parameters())

    def loss(self, engine, batch):
        scores = engine.score(batch.sequences, batch.prompt_lens, trace=batch.trace, temperature=self.temperature)
        ref = None
        if self.ref is not None:
            with torch.no_grad():
                ref = self.ref.score(batch.sequences, batch.prompt_lens, temperature=self.temperature).logprobs
        rl = self.rl
        loss, metrics = grpo_loss(
            scores.logprobs,
            batch.old_logprobs,
            batch.advantages,
            scores.mask,
            eps_low=rl.eps_low,
            eps_high=rl.eps_high,
            ref_logprobs=ref,
            beta=rl.kl_coef,
            aggregation=rl.aggregation,
            num_items=batch.num_items,
        )
        return loss, scores, metrics

    def state(self, model) -> Push:
        """The model's weights (``Push(weights=state_dict)``)."""
        # Copies: under DeepSpeed ZeRO-1/2 every parameter is a view of one flat buffer, and
        # pickling a view ships its whole storage, so each tensor would carry the whole model.
        return Push(weights={k: v.detach().cpu().clone() for k, v in model.state_dict().items()})

    def load(self, model, state: Push) -> None:
        """Load :meth:`state`'s weights (a plain state dict, as older checkpoints hold, loads too)."""
        model.load_state_dict(dict(state))
