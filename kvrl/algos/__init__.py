"""RL algorithms on the shared loop (``kvrl/workers/controller.py``) and the GRPO core.

An algorithm is a class built from the typed config, ``Algo(cfg)``, that declares:

* ``rollout_policy(model)`` — the KV policy rollouts run under (``None`` = full cache);
* ``setup(model, tokenizer) -> list[Parameter]`` — on a learner: anything it keeps beside
  the model (a reference model), and the parameters the optimizer updates;
* ``loss(engine, batch) -> (loss, scores, metrics)`` — the learner loss on a collated
  :class:`kvrl.workers.learner.Batch`, with the recomputed :class:`kvrl.engines.hf.Scores`
  (the learner measures the train/inference mismatch from them);
* ``state(model)`` / ``load(model, state)`` — the trainable state: pushed to every rollout
  worker after each update and saved in checkpoints;
* ``pushes`` — what that state is, so a rollout worker of either engine can take it:
  ``"weights"`` (a model state dict), ``"gates"`` (``{"gates": [layers, kv_heads]}`` for
  the rollout policy's ``.gates``) or ``"scorer"`` (a state dict of the rollout policy's
  ``.scorer``); see :mod:`kvrl.workers.rollout`.

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
