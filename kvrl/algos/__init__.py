"""RL algorithms on the shared loop (``kvrl/workers/controller.py``) and the GRPO core.

An algorithm is a class built from the typed config, ``Algo(cfg)``, that declares:

* ``rollout_policy(model)`` — the cache regime rollouts run under (:mod:`kvrl.policies.regime`:
  ``Full()``, ``Evicting(policy)``, ``Static(pattern)``, ``Mixed(gates, sink, recent)``);
* ``setup(model, tokenizer) -> list[Parameter]`` — on a learner: anything it keeps beside
  the model (a reference model), and the parameters the optimizer updates;
* ``loss(engine, batch) -> (loss, scores, metrics)`` — the learner loss on a collated
  :class:`kvrl.workers.learner.Batch`, with the recomputed :class:`kvrl.engines.hf.Scores`
  (the learner measures the train/inference mismatch from them);
* ``state(model) -> Push`` / ``load(model, push)`` — the trainable state
  (:class:`kvrl.algos.push.Push`): pushed to every rollout worker after each update and
  saved in checkpoints. ``push.weights`` is a model state dict (full-model training),
  ``push.cache`` the rollout regime's trainable state (``regime.state()``: RLKV's gates, a
  learned scorer); a rollout worker of either engine loads each part that is present
  (see :mod:`kvrl.workers.rollout`).

Algorithms see engines and environments only through those interfaces. ``ALGOS`` maps
``rl.algo`` to ``"module:Class"``; modules are imported only when chosen.
"""

ALGOS = {
    "rl_full": "kvrl.algos.rl_full:RLFull",
    "rl_sparse": "kvrl.algos.rl_sparse:RLSparse",
    "distill": "kvrl.algos.distill:Distill",
    "rlkv": "kvrl.algos.rlkv:RLKV",
}


def make_algo(cfg):
    """The algorithm named by ``cfg.rl.algo``, built from the config."""
    from kvrl.envs.registry import load_entry_point

    if cfg.rl.algo not in ALGOS:
        raise ValueError(f"unknown rl.algo {cfg.rl.algo!r}; available: {', '.join(ALGOS)}")
    return load_entry_point(ALGOS[cfg.rl.algo])(cfg)
