"""G-KV RL-Sparse: GRPO on the whole model under the compressed cache it is served with.

G-KV (Liao et al. 2025, "G-KV", §5 "RL-Sparse"):
rollouts decode under G-KV eviction and record which key each KV head stopped seeing
when; the learner recomputes the logprobs with attention restricted by exactly that
record, so the policy being trained is the policy that generated the samples. The replay
is exact (float64: ``test_replay_is_exact_in_float64``); in float32 the logged
train/inference mismatch is ~1e-8 per token on average (``mismatch_mean``) but its max over
a step's tokens (``mismatch_max``) reaches ~1e-4 to 1e-3 on rare ill-conditioned tokens of
the tiny reasoner at temperature 2, where each side alone is that far from the exact value
(``benchmarks/micro/replay_precision.py``).

What the loop needs from it, beyond RL-Full (whose GRPO loss, reference model and
weight push it reuses unchanged):

* rollouts run under ``make_policy(kv.policy, budget, interval, window, sink, budget_ratio,
  **kv.kwargs)``: the paper's ``kv.policy=gkv`` (α and the mix λ come in ``kv.kwargs``;
  ``kv.budget_ratio`` is G-KV's ratio mode), or any other token policy, a class of your own
  included (``kv.policy=pkg.module:Class``), or ForesightKV's trained scorer (``kv.policy=learned``,
  ``kv.kwargs.run``: a job=foresight run, the scorer frozen): the learner replays whatever trace it left,
  and needs no policy. They return their
  :class:`kvrl.cache.EvictionTrace`, O(layers·B·H_kv·T) int death times;
* the learner's ``engine.score(..., trace=batch.trace)`` replays the trace through the
  ``"kvrl_replay"`` attention (a flex-attention BlockMask built from the death times on
  GPU; never a stored per-head T×T mask, the reference's O(L·H·T²) memory problem);
* GRPO without KL (``rl.kl_coef=0`` in the recipes, the paper's). With ``rl.kl_coef > 0`` the reference is
  RL-Full's, the initial weights, and it scores the samples with the full cache (no trace): the KL pulls the
  compressed-cache policy toward what the initial model says with every token in view. Truncated samples'
  advantages are set by ``rl.truncated`` in the controller (the paper: 0).
"""

from __future__ import annotations

from kvrl.algos import rl_sparse_config
from kvrl.algos.rl_full import RLFull
from kvrl.policies import Evicting, make_policy
from kvrl.runlog import scorer_file


class RLSparse(RLFull):
    """RL-Sparse (G-KV, arXiv 2512.00504, §5; microsoft/G-KV@6db3b2e ``gkv/rl_main.py``): RL-Full's
    GRPO with rollouts under G-KV and logprobs recomputed under the rollouts' traces
    (``batch.trace``: death times [layers, B, H_kv, T])."""

    def __init__(self, cfg):
        # its rules (kv.policy=gkv, a kv.budget with room to choose) are the config gate's: rl_sparse_config.py
        super().__init__(cfg)
        self.kv = cfg.kv

    def rollout_policy(self, model) -> Evicting:
        """``kv.policy`` (G-KV in the paper) with the ``kv`` section's budget, schedule and ``kv.kwargs``.
        ``kv.policy=learned`` loads the trained scorer ``kv.kwargs.run`` names (frozen: RL-Sparse pushes only
        the model's weights) onto the model's device; it scores the keys, values and attention of the
        rollout engine's model, which holds the weights being trained."""
        kv = self.kv
        own = dict(kv.kwargs)
        run = own.pop("run", None) if kv.policy == "learned" else None
        policy = make_policy(
            kv.policy,
            model.config,
            budget=kv.budget,
            interval=kv.interval,
            window=kv.window,
            sink=kv.sink,
            budget_ratio=kv.budget_ratio,
            **own,
        )
        if kv.policy == "learned":
            found = None if run is None else scorer_file(run)
            if found is None:  # the config path and the gate say so before the run: here for a cfg built otherwise
                rules = rl_sparse_config.scorer_problems(self.cfg) or rl_sparse_config.problems(self.cfg)
                raise ValueError("; ".join(rules))
            policy.load_scorer(found)  # refused, naming the fix, when trained on another model
            if model.device.type != "meta":  # vLLM's worker holds a meta model and moves the scorer itself
                policy.scorer.to(model.device)
        return Evicting(policy)

    def loss(self, engine, batch):
        if batch.trace is None:  # without it the learner would silently train with the full cache
            raise ValueError(
                "rl_sparse got samples without an eviction trace: the rollout engine must "
                "decode under rollout_policy() and return its traces"
            )
        return super().loss(engine, batch)
