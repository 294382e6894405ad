"""RolloutWorker: a Ray actor wrapping a rollout engine; samples come back version-stamped.

The worker generates and scores: the controller owns the environment's task stream, the
worker scores its samples with its own copy of the environment (``Algorithm.generate``), and
the learner owns the optimizer. Its engine (``workers.engine``, or the one the algorithm's
rollouts need) is the reference
:class:`kvrl.engines.hf.HFEngine` or :class:`kvrl.engines.vllm.VLLMEngine`, in-process in
the actor; both have the ``generate(prompts, Sampling, policy) -> Rollouts`` contract. The
trainable state arrives through :meth:`RolloutWorker.load` from the object store, tagged
with the policy version, and every sample it returns carries that version (the version is
read when generation starts, on the worker, so a push queued behind a running generation
can never relabel its samples; AReaL PR #1569 fixed exactly that bug).

A push is the algorithm's :class:`kvrl.algos.push.Push` with the learner's per-part
checksums (``Push.digest``); the worker loads each part that is present:

* ``weights`` (a model state dict) into the engine with ``engine.push_weights``. HF: loaded,
  then the model's bytes are checksummed against the learner's; vLLM: every tensor is
  compared on vLLM's side (its parameters are renamed and fused, so a checksum cannot be
  compared).
* ``cache`` (the rollout regime's trainable state: RLKV's gates, a learned scorer) into the
  worker's regime with ``regime.load_state``, then checksummed. The vLLM engine
  re-installs a regime whose content changed at the next ``generate``, so its workers run
  exactly these bytes.
"""

from __future__ import annotations

import ray
import torch

from kvrl.algos import make_algo
from kvrl.algos.base import Sample
from kvrl.algos.push import Push
from kvrl.engines import make_engine
from kvrl.models.tiny import resolve_path
from kvrl.policies import as_regime
from kvrl.policies.regime import checksum
from kvrl.runlog import setup_process


def build_native_ops(device: str) -> None:
    """Build (or load) the CPU kernels as the worker starts, not inside step 1's timed rollout. A function of
    its own: Ray pickles the actor class by value, and a name ``ops`` in ``__init__`` beside its global
    ``torch`` makes cloudpickle take ``torch.ops`` along, which does not pickle."""
    if str(device).split(":")[0] == "cpu":
        from kvrl.kernels.cpu.native import ops

        ops()


@ray.remote
class RolloutWorker:
    def __init__(self, cfg, rank: int):
        setup_process()  # actors share cores: one thread each (kvrl.runlog)
        self.cfg, self.rank = cfg, rank
        self.algo = make_algo(cfg)
        self.engine = make_engine(cfg, kind=self.algo.rollout_engine)
        build_native_ops(cfg.device)
        model = getattr(self.engine, "model", None)
        self.env = self.algo.make_env(model)  # scores the samples here, in parallel across the actors
        if model is None:  # vLLM holds the weights; the policy needs the architecture only
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_path(cfg.model.path)))
        self.regime = as_regime(self.algo.rollout_policy(model))
        # None until the controller sends weights: a restarted actor holds only the base
        # weights, and must not generate samples that would be stamped with a version.
        self.version: int | None = None

    def load(self, state: Push, version: int, digest: dict[str, str]) -> None:
        """Take the trainable state of policy `version` (see the module docstring), and
        check that this worker now generates with exactly the learner's bytes (``digest``:
        the learner's ``state.digest()``)."""
        held = {}
        if state.weights is not None:
            # raises unless every tensor arrived; the HF engine returns its model's checksum
            held["weights"] = self.engine.push_weights(state.weights).get("checksum")
        if state.cache is not None:
            self.regime.load_state(state.cache)
            held["cache"] = checksum(self.regime.state())
        for part, value in held.items():
            if value is not None and value != digest.get(part):
                raise RuntimeError(
                    f"rollout worker {self.rank} holds {part} with checksum {value} after the push "
                    f"of version {version}, the learner's is {digest.get(part)}"
                )
        self.version = version

    def generate(self, ids: list[str], tasks: list, seed: int) -> tuple[list[Sample], dict]:
        """One shard: a scored sample per (id, task), in order (``Algorithm.generate``), each
        stamped with the version of the weights this worker holds when it starts."""
        if self.version is None:
            raise RuntimeError(f"rollout worker {self.rank} has no pushed weights: call load() first")
        return self.algo.generate(self.engine, self.regime, self.env, ids, tasks, seed, self.version)
