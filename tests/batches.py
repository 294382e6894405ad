"""What a learner receives, built from an engine's output, and the traces ForesightKV learns from:
shared by the algorithm tests."""

import torch

from kvrl.algos.base import Sample, collate
from kvrl.data.traces import Trace
from kvrl.engines.base import Sampling
from kvrl.engines.hf import HFEngine
from kvrl.envs import make


def rollout_samples(out, advantages, ids=None, rewards=None) -> list[Sample]:
    """The rows of ``out`` (:class:`kvrl.engines.base.Rollouts`) as version-0 samples with the given
    advantages (and rewards), ids ``ids[b]`` (default ``str(b)``), and their eviction traces (none under
    the full cache)."""
    return [
        Sample(
            id=str(b) if ids is None else ids[b],
            prompt_ids=out.prompt_ids[b],
            tokens=out.tokens[b],
            logprobs=out.logprobs[b],
            finish_reason=out.finish_reasons[b],
            text=out.texts[b],
            version=0,
            trace=None if out.traces is None else out.trace(b),
            reward=0.0 if rewards is None else rewards[b],
            advantage=advantages[b],
        )
        for b in range(len(out.tokens))
    ]


def learner_batch(out, advantages, device):
    """:func:`rollout_samples` collated as a learner gets them."""
    samples = rollout_samples(out, advantages)
    return collate(samples, sum(len(s.tokens) for s in samples), device)


def counts_traces(model, tok, n: int, max_new_tokens: int) -> list[Trace]:
    """``n`` greedy full-cache traces of counts tasks (seed 123's stream) with their per-token
    full-cache losses and entropies."""
    engine = HFEngine(model, tok)
    env = make("kvrl/counts-v0")
    env.reset(seed=123)
    tasks = env.tasks(n)
    out = engine.generate([t.prompt for t in tasks], Sampling(max_new_tokens=max_new_tokens))
    with torch.no_grad():
        s = engine.score(out)
    return [
        Trace(t.id, p + g, len(p), s.losses[i, : len(g)].tolist(), s.entropies[i, : len(g)].tolist())
        for i, (t, p, g) in enumerate(zip(tasks, out.prompt_ids, out.tokens))
    ]
