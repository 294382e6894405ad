"""RolloutWorker: a Ray actor wrapping a rollout engine; samples come back version-stamped.

The worker only generates: the controller owns the environment (tasks, rewards) and the
learner owns the optimizer. Its engine (``workers.engine``) is the reference
:class:`kvrl.engines.hf.HFEngine` or :class:`kvrl.engines.vllm.VLLMEngine`, in-process in
the actor; both have the ``generate(prompts, Sampling, policy) -> Rollouts`` contract. The
trainable state arrives through :meth:`RolloutWorker.load` from the object store, tagged
with the policy version, and every sample it returns carries that version (the version is
read when generation starts, on the worker, so a push queued behind a running generation
can never relabel its samples; AReaL PR #1569 fixed exactly that bug).

What a push holds is the algorithm's ``pushes``:

* ``"weights"``: a model state dict. HF: loaded, then the model's bytes are checksummed
  against the learner's; vLLM: through ``push_weights``, which compares every tensor on
  vLLM's side (its parameters are renamed and fused, so a checksum cannot be compared).
* ``"gates"`` (``{"gates": [layers, kv_heads]}``) and ``"scorer"`` (a state dict of
  ``policy.scorer``): written into the rollout policy object, then checksummed. The vLLM
  engine re-installs a policy whose content changed at the next ``generate``, so its
  workers run exactly these bytes.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import ray
import torch

from kvrl.algos import make_algo
from kvrl.cache import EvictionTrace
from kvrl.engines import make_engine
from kvrl.engines.hf import Sampling
from kvrl.models.tiny import resolve_path
from kvrl.runlog import setup_process


@dataclass
class Sample:
    """One generated completion, from the worker to the controller to a learner.

    ``id`` is ``"step/task/g"``: unique within a run, which is how the controller checks
    that every sample of a step is trained on exactly once, even after a worker died.
    """

    id: str
    prompt_ids: list[int]
    tokens: list[int]  # generated ids, without padding or EOS
    logprobs: list[float]  # behaviour logprobs of `tokens` (at the sampling temperature)
    finish_reason: str  # "stop" (EOS) or "length" (cut at max_new_tokens)
    text: str
    version: int  # policy version of the weights that generated it
    trace: EvictionTrace | None = None  # this sample's eviction trace; None = full cache
    reward: float = 0.0  # set by the controller from env.score
    advantage: float = 0.0  # set by the controller (kvrl.algos.grpo)


def checksum(state: dict[str, torch.Tensor]) -> str:
    """A digest of the exact bytes of a state dict: the learner's and every worker's must
    match after a push (the "weights equal after sync" check users ask for)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@ray.remote
class RolloutWorker:
    def __init__(self, cfg, rank: int):
        setup_process()  # actors share cores: one thread each (kvrl.runlog)
        self.cfg, self.rank = cfg, rank
        self.algo = make_algo(cfg)
        self.engine = make_engine(cfg)
        model = getattr(self.engine, "model", None)
        if model is None:  # vLLM holds the weights; the policy needs the architecture only
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_path(cfg.model.path)))
        self.policy = self.algo.rollout_policy(model)
        # None until the controller pushes weights: a restarted actor holds only the base
        # weights, and must not generate samples that would be stamped with a version.
        self.version: int | None = None

    def load(self, state: dict, version: int, digest: str) -> None:
        """Take the trainable state of policy `version` (see the module docstring), and
        check that this worker now generates with exactly the learner's bytes."""
        kind = self.algo.pushes
        if kind == "weights" and self.cfg.workers.engine == "vllm":
            self.engine.push_weights(state)  # raises unless every tensor arrived
            self.version = version
            return
        if kind == "weights":
            self.algo.load(self.engine.model, state)
            held = checksum(self.algo.state(self.engine.model))
        elif kind == "gates":
            self.policy.gates = state["gates"].detach().clone().to(self.policy.gates.dtype)
            held = checksum({"gates": self.policy.gates})
        elif kind == "scorer":
            self.policy.scorer.load_state_dict(state)
            held = checksum(self.policy.scorer.state_dict())
        else:
            raise ValueError(f"{type(self.algo).__name__}.pushes = {kind!r}: must be weights | gates | scorer")
        if held != digest:
            raise RuntimeError(f"rollout worker {self.rank} holds a state with checksum {held} after the push "
                               f"of version {version}, the learner's is {digest}")
        self.version = version

    def generate(self, ids: list[str], prompts: list[str], seed: int) -> tuple[list[Sample], dict]:
        """One shard: a sample per (id, prompt), in order, generated in chunks of
        sampling.batch_size with seeds seed, seed+1, ... (so a redone shard is identical)."""
        if self.version is None:
            raise RuntimeError(f"rollout worker {self.rank} has no pushed weights: call load() first")
        version, sc = self.version, self.cfg.sampling
        samples, tokens, start = [], 0, time.perf_counter()
        for c, lo in enumerate(range(0, len(prompts), sc.batch_size)):
            hi = lo + sc.batch_size
            sampling = Sampling(max_new_tokens=sc.max_new_tokens, temperature=sc.temperature, seed=seed + c)
            out = self.engine.generate(prompts[lo:hi], sampling, policy=self.policy)
            for b, sid in enumerate(ids[lo:hi]):
                samples.append(Sample(
                    id=sid, prompt_ids=out.prompt_ids[b], tokens=out.tokens[b], logprobs=out.logprobs[b],
                    finish_reason=out.finish_reasons[b], text=out.texts[b], version=version,
                    trace=None if out.traces is None else out.trace(b)))
                tokens += len(out.tokens[b])
        return samples, {"tokens": tokens, "seconds": time.perf_counter() - start}
