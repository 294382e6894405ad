"""What an algorithm and the shared loop exchange: samples, learner batches, and the text rollout.

:class:`Algorithm` is the base of every ``rl.algo``. Its rollout side is text generation,
which RL-Full, RL-Sparse, Distill and RLKV share: the rollout worker asks it for the
environment (:meth:`Algorithm.make_env`), then for each shard of a step to
:meth:`Algorithm.generate` samples, which decodes the tasks' prompts with the worker's engine
under the rollout regime and scores every completion with the environment right there, in
parallel across the rollout actors and inside ``workers.timeout_s``. The learner turns its
share of samples into a :class:`Batch` with :meth:`Algorithm.collate`. ForesightKV's stage 2
(:class:`kvrl.algos.foresight.ForesightRL`) overrides the three: its rollouts are episodes
of the eviction MDP, not text.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvrl.algos.push import Push
from kvrl.cache import EvictionTrace
from kvrl.engines.base import Sampling, Scores
from kvrl.envs import Task, make
from kvrl.kernels import NEVER


@dataclass
class Sample:
    """One rollout, from a rollout worker to the controller to a learner.

    ``id`` is ``"step/task/g"``: unique within a run, which is how the controller checks
    that every sample of a step is trained on exactly once, even after a worker died.
    """

    id: str
    prompt_ids: list[int]
    tokens: list[int]  # generated ids, without padding; a stopped sample ends with its stop token
    logprobs: list[float]  # behaviour logprobs of the sample's actions (text: of `tokens`, at the temperature)
    finish_reason: str  # "stop" (a stop id) or "length" (cut at max_new_tokens or the model length)
    text: str
    version: int  # policy version of the weights that generated it
    trace: EvictionTrace | None = None  # this sample's eviction trace; None = full cache
    reward: float = 0.0  # the environment's reward, scored on the rollout worker
    info: dict = field(default_factory=dict)  # the environment's metrics of this sample
    # set by the controller (kvrl.algos.grpo): the sample's, or each generated token's (rl.credit=segment)
    advantage: float | list[float] = 0.0
    # rl.credit=segment: each generated token's segment (-1: none) and each segment's reward, from the environment
    segments: tuple[list[int], list[float]] | None = None
    data: object = None  # what else the algorithm's learner needs (ForesightKV: the episode's decisions)


@dataclass
class Batch:
    """A learner's share of one step, collated for ``Algorithm.loss``.

    Tensors are [B, T] left-aligned like :class:`kvrl.engines.base.Scores` (column j =
    generated token j, or decision j), zero beyond each sample.
    """

    sequences: list[list[int]]  # prompt + generated ids
    prompt_lens: list[int]
    old_logprobs: torch.Tensor  # behaviour logprobs [B, T]
    mask: torch.Tensor  # [B, T] 1 on generated tokens
    advantages: torch.Tensor  # [B], or [B, T] per token (rl.credit=segment)
    rewards: torch.Tensor  # raw rewards of the learner's whole share (RLKV's adaptive penalty reads their mean)
    trace: EvictionTrace | None  # the samples' traces batched; None = full cache
    num_items: float  # normaliser of the whole step (all learners): tokens or sequences
    data: object = None  # the algorithm's own collated data (ForesightKV: the decisions)
    # the micro-batch that also carries the learner's per-step terms (RLKV's penalty on the gates);
    # the others carry only their samples' terms, so the summed gradient is the whole share's
    first: bool = True


def micro_batches(samples: list[Sample], tokens: int, size) -> list[list[Sample]]:
    """Consecutive runs of ``samples`` whose padded size stays within ``tokens`` (0: one run); a sample larger
    than that is a run of its own. ``size(sample)`` gives the dimensions the sample is padded along
    (:meth:`Algorithm.size`); a run's padded size is its count x the product of their maxima."""
    parts: list[list[Sample]] = []
    longest: tuple[int, ...] = ()
    for s in samples:
        dims = size(s)
        grown = tuple(map(max, longest, dims)) if parts else dims
        if parts and (tokens == 0 or (len(parts[-1]) + 1) * math.prod(grown) <= tokens):
            parts[-1].append(s)
            longest = grown
        else:
            parts.append([s])
            longest = dims
    return parts


def collate(samples: list[Sample], num_items: float, device) -> Batch:
    """Text samples -> a left-aligned batch with their traces batched."""
    T = max(len(s.tokens) for s in samples)
    old = torch.tensor([s.logprobs + [0.0] * (T - len(s.logprobs)) for s in samples], device=device)
    mask = torch.tensor([[1.0] * len(s.tokens) + [0.0] * (T - len(s.tokens)) for s in samples], device=device)
    if any(isinstance(s.advantage, list) for s in samples):  # per token, 0 beyond each sample
        adv = [s.advantage if isinstance(s.advantage, list) else [s.advantage] * len(s.tokens) for s in samples]
        advantages = torch.tensor([a + [0.0] * (T - len(a)) for a in adv], device=device)
    else:
        advantages = torch.tensor([s.advantage for s in samples], device=device)
    trace = None
    if any(s.trace is not None for s in samples):
        # per-sample traces of different lengths -> one batch; padding keys are never seen
        L = max(len(s.prompt_ids) + len(s.tokens) for s in samples)
        death = torch.cat([F.pad(s.trace.full(), (0, L - s.trace.death.shape[-1]), value=NEVER) for s in samples], 1)
        lengths = torch.cat([s.trace.lengths for s in samples])
        trace = EvictionTrace.from_death(death.to(device), lengths.to(device))
    return Batch(
        sequences=[s.prompt_ids + s.tokens for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        old_logprobs=old,
        mask=mask,
        advantages=advantages,
        rewards=torch.tensor([s.reward for s in samples], device=device),
        trace=trace,
        num_items=num_items,
    )


class Algorithm:
    """The shared part of every algorithm (see :mod:`kvrl.algos` for the whole contract)."""

    rollout_engine: str | None = None  # the engine its rollouts need; None = workers.engine
    # it trains the model's own weights: each checkpoint then also holds them as a transformers folder
    # (model/), which model.path=<output_dir> loads (kvrl.runlog.trained_model)
    trains_weights: bool = False
    # given by path (rl.algo=pkg.module:Class): the config section its module registers
    # (kvrl.section.register_section), whose keys and rules then apply; None = none. A registered
    # algorithm's section is its rl.algo name (kvrl.algos.ALGOS)
    section: str | None = None
    # its loss reads the rewards (through the advantages): a run whose every group has one reward for
    # all its samples learns nothing (the controller warns); False for a loss that ignores them
    learns_from_rewards: bool = True
    # its loss has no gradient but the advantages' (a KL to the reference aside): a step whose advantages are
    # all 0 is skipped under rl.no_signal=skip. False for a loss with a term that trains regardless
    advantages_only: bool = True

    def __init__(self, cfg):
        self.cfg = cfg

    def size(self, sample: Sample) -> tuple[int, ...]:
        """The dimensions along which the learner pads ``sample`` (:func:`micro_batches`, whose product
        ``trainer.micro_batch_tokens`` bounds): its prompt and completion tokens."""
        return (len(sample.prompt_ids) + len(sample.tokens),)

    def make_env(self, model=None):
        """The environment: the controller draws tasks from it (``model`` None), each rollout
        worker scores its samples with its own copy (``model``: the engine's, if it has one)."""
        return make(self.cfg.env.id, **self.cfg.env.kwargs)

    def rollout_policy(self, model):
        """The cache regime rollouts run under (anything :func:`kvrl.policies.as_regime` takes)."""
        return None

    # ---- the hooks every algorithm defines (the learner's side)

    def setup(self, model, tokenizer) -> list[torch.nn.Parameter]:
        """On a learner, once, before a checkpoint is loaded into ``model``: build what the loss keeps
        beside the model (a frozen reference) and return the parameters the optimizer updates."""
        raise NotImplementedError(f"{type(self).__name__} must define setup(model, tokenizer)")

    def loss(self, engine, batch: Batch) -> tuple[torch.Tensor, Scores, dict]:
        """The learner's loss on a collated batch: (scalar loss, the recomputed :class:`Scores` of
        ``batch.sequences``, from which the learner measures the train/inference mismatch, metrics)."""
        raise NotImplementedError(f"{type(self).__name__} must define loss(engine, batch)")

    def state(self, model) -> Push:
        """The trainable state, pushed to every rollout worker after each update and saved in
        checkpoints: ``Push(weights=...)`` for the model's weights, ``Push(cache=...)`` for the rollout
        regime's (gates, a scorer)."""
        raise NotImplementedError(f"{type(self).__name__} must define state(model)")

    def load(self, model, state: Push) -> None:
        """Load what :meth:`state` returned (from a checkpoint) into ``model`` and this algorithm."""
        raise NotImplementedError(f"{type(self).__name__} must define load(model, state)")

    # ---- the rollout side every text algorithm shares

    def generate(
        self, engine, regime, env, ids: list[str], tasks: list[Task], seed: int, version: int
    ) -> tuple[list[Sample], dict]:
        """A shard: a sample per (id, task), in order, decoded in chunks of sampling.batch_size
        with seeds seed, seed+1, ... (so a redone shard is identical) and scored by ``env``."""
        sc, by_segment = self.cfg.sampling, self.cfg.rl.credit == "segment"
        samples, tokens, start = [], 0, time.perf_counter()
        for c, lo in enumerate(range(0, len(tasks), sc.batch_size)):
            chunk = tasks[lo : lo + sc.batch_size]
            sampling = Sampling(max_new_tokens=sc.max_new_tokens, temperature=sc.temperature, seed=seed + c)
            out = engine.generate([t.prompt for t in chunk], sampling, policy=regime)
            for b, (sid, task) in enumerate(zip(ids[lo : lo + sc.batch_size], chunk)):
                reward, info = env.score(task, out.texts[b])
                segments = None
                if by_segment:  # the environment reads the tokens as text pieces: one per token
                    pieces = [engine.tokenizer.decode([t]) for t in out.tokens[b]]
                    segments = env.segments(task, out.texts[b], pieces)
                    if segments is None:
                        raise ValueError(
                            f"rl.credit=segment needs an environment that splits a completion into segments with "
                            f"their own rewards, but {type(env).__name__} defines no segments(); set "
                            "rl.credit=sequence (kvrl/multihop-v0 defines them: a segment per query)"
                        )
                samples.append(
                    Sample(
                        id=sid,
                        prompt_ids=out.prompt_ids[b],
                        tokens=out.tokens[b],
                        logprobs=out.logprobs[b],
                        finish_reason=out.finish_reasons[b],
                        text=out.texts[b],
                        version=version,
                        trace=None if out.traces is None else out.trace(b),
                        reward=reward,
                        info=info,
                        segments=segments,
                    )
                )
                tokens += len(out.tokens[b])
        return samples, {"tokens": tokens, "seconds": time.perf_counter() - start}

    def collate(self, samples: list[Sample], num_items: float, device) -> Batch:
        return collate(samples, num_items, device)
