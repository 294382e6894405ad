"""RL algorithms on the shared loop (``kvrl/workers/controller.py``) and the GRPO core.

An algorithm is a subclass of :class:`kvrl.algos.base.Algorithm` built from the typed
config, ``Algo(cfg)``. The base gives the text rollout every algorithm but ForesightKV's
shares (``make_env``: the environment, ``generate``: decode a shard and score it on the
rollout worker, ``collate``: a learner's :class:`~kvrl.algos.base.Batch`, ``size``: the dimensions
``collate`` pads a sample along, which ``trainer.micro_batch_tokens`` bounds, and ``rollout_engine``: the
engine the rollouts need); each algorithm defines the hooks the base
declares (their signatures and contracts are on :class:`~kvrl.algos.base.Algorithm`):

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

Algorithms see engines and environments only through those interfaces.

Adding one to kvrl is its module, the light module of its config keys and rules beside it
(``<algo>_config.py``: no torch, it registers a section with :func:`kvrl.section.register_section`;
see :mod:`kvrl.section`), and one line in ``ALGOS``: its class, that config module (imported
below, so the section registers when the config is loaded) and the job that runs it. Modules of
the algorithms themselves are imported only when chosen.

An algorithm outside kvrl needs no line: ``rl.algo=pkg.module:Class`` (as ``env.id`` and
``kv.policy`` take a path). The config loader imports that module before it reads any key
(:func:`algo_class`), so a section the module registers at import is in the schema; the class's
``section`` attribute names it, and its rules run with the job's. Whichever job the config names
runs it (``job=rl``; ``job=rlkv`` for a subclass of RLKV).
"""

import difflib
import importlib
from dataclasses import dataclass

from kvrl.section import ConfigError


@dataclass(frozen=True)
class Algo:
    entry: str  # "module:Class", imported only when the algorithm is built
    config: str = ""  # the light module that registers its section ("" = no keys or rules of its own)
    job: str = "rl"  # the job that runs it (kvrl.jobs.JOBS)
    # its loss weighs each generated token by that token's advantage, so rl.credit=segment can apply
    token_advantages: bool = False


# rl.algo -> Algo
ALGOS = {
    "rl_full": Algo("kvrl.algos.rl_full:RLFull", "kvrl.algos.rl_full_config", token_advantages=True),
    "rl_sparse": Algo("kvrl.algos.rl_sparse:RLSparse", "kvrl.algos.rl_sparse_config", token_advantages=True),
    "distill": Algo("kvrl.algos.distill:Distill", "kvrl.algos.distill_config"),
    "rlkv": Algo("kvrl.algos.rlkv:RLKV", "kvrl.algos.rlkv_config", job="rlkv"),
    "foresight": Algo("kvrl.algos.foresight:ForesightRL", job="foresight"),  # stage 2; kvrl/jobs/foresight_config.py
}

for _algo in ALGOS.values():  # their sections register now: the config's schema is built from them
    if _algo.config:
        importlib.import_module(_algo.config)


def algo_class(path: str) -> type:
    """The class of ``rl.algo=pkg.module:Class``, imported (which registers any section its module
    declares). Raises ConfigError naming the nearest registered algorithm and the fix."""
    from kvrl.envs.registry import load_entry_point

    near = difflib.get_close_matches(path.rpartition(":")[2].lower(), ALGOS, n=1, cutoff=0.5) or [next(iter(ALGOS))]
    instead = f"set rl.algo={near[0]} (registered: {', '.join(ALGOS)})"
    try:
        cls = load_entry_point(path)
    except (ImportError, AttributeError, ValueError) as err:  # a typo costs no torch: the base is imported after
        raise ConfigError(
            f"rl.algo={path!r} cannot be imported ({' '.join(str(err).split())}); {instead}, or put "
            f"the package of {path.partition(':')[0]!r} on PYTHONPATH (a Ray job: launch/ray_submit.sh "
            "--py-module path/to/pkg)"
        ) from None
    from kvrl.algos.base import Algorithm

    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(
            f"rl.algo={path!r} is not a subclass of kvrl.algos.base.Algorithm; {instead}, or name your subclass"
        )
    return cls


def make_algo(cfg):
    """The algorithm named by ``cfg.rl.algo`` (a name in ``ALGOS`` or a path), built from the config."""
    from kvrl.envs.registry import load_entry_point

    if ":" in cfg.rl.algo:
        return algo_class(cfg.rl.algo)(cfg)
    if cfg.rl.algo not in ALGOS:
        raise ValueError(f"unknown rl.algo {cfg.rl.algo!r}; available: {', '.join(ALGOS)}, or pkg.module:Class")
    return load_entry_point(ALGOS[cfg.rl.algo].entry)(cfg)
