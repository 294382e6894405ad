"""RL algorithms on the shared loop (``kvrl/workers/controller.py``) and the GRPO core.

An algorithm is a subclass of :class:`kvrl.algos.base.Algorithm` built from the typed
config, ``Algo(cfg)``. The base gives the text rollout every algorithm but ForesightKV's
shares (``make_env``: the environment, ``generate``: decode a shard and score it on the
rollout worker, ``collate``: a learner's :class:`~kvrl.algos.base.Batch`, and
``rollout_engine``: the engine the rollouts need); each algorithm declares:

* ``rollout_policy(model)`` — the cache regime rollouts run under (:mod:`kvrl.policies.regime`:
  ``Full()``, ``Evicting(policy)``, ``Static(pattern)``, ``Mixed(gates, sink, recent)``);
* ``setup(model, tokenizer) -> list[Parameter]`` — on a learner: anything it keeps beside
  the model (a reference model), and the parameters the optimizer updates;
* ``loss(engine, batch) -> (loss, scores, metrics)`` — the learner loss on a collated
  :class:`kvrl.algos.base.Batch`, with the recomputed :class:`kvrl.engines.base.Scores`
  (the learner measures the train/inference mismatch from them);
* ``state(model) -> Push`` / ``load(model, push)`` — the trainable state
  (:class:`kvrl.algos.push.Push`): pushed to every rollout worker after each update and
  saved in checkpoints. ``push.weights`` is a model state dict (full-model training),
  ``push.cache`` the rollout regime's trainable state (``regime.state()``: RLKV's gates, a
  learned scorer); a rollout worker of either engine loads each part that is present
  (see :mod:`kvrl.workers.rollout`).

Algorithms see engines and environments only through those interfaces. ``ALGOS`` maps
``rl.algo`` to ``"module:Class"``; modules are imported only when chosen. An algorithm's config
keys and rules sit beside it in ``<algo>_config.py`` (light: the config gate imports it before
anything starts, see :mod:`kvrl.section`), imported below so that they register; the job that runs
it lists it in ``kvrl.jobs.JOBS``.
"""

from kvrl.algos import distill_config, rl_full_config, rl_sparse_config, rlkv_config  # noqa: F401

ALGOS = {
    "rl_full": "kvrl.algos.rl_full:RLFull",
    "rl_sparse": "kvrl.algos.rl_sparse:RLSparse",
    "distill": "kvrl.algos.distill:Distill",
    "rlkv": "kvrl.algos.rlkv:RLKV",
    "foresight": "kvrl.algos.foresight:ForesightRL",  # stage 2 of job=foresight
}


def make_algo(cfg):
    """The algorithm named by ``cfg.rl.algo``, built from the config."""
    from kvrl.envs.registry import load_entry_point

    if cfg.rl.algo not in ALGOS:
        raise ValueError(f"unknown rl.algo {cfg.rl.algo!r}; available: {', '.join(ALGOS)}")
    return load_entry_point(ALGOS[cfg.rl.algo])(cfg)
