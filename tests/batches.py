"""What a learner receives, built from an engine's output: shared by the algorithm tests."""

from kvrl.algos.base import Sample, collate


def learner_batch(out, advantages, device):
    """The rows of ``out`` (:class:`kvrl.engines.base.Rollouts`) as version-0 samples
    with the given advantages and their eviction traces (none under the full cache), collated
    as a learner gets them."""
    samples = [
        Sample(
            id=str(b),
            prompt_ids=out.prompt_ids[b],
            tokens=out.tokens[b],
            logprobs=out.logprobs[b],
            finish_reason=out.finish_reasons[b],
            text=out.texts[b],
            version=0,
            trace=None if out.traces is None else out.trace(b),
            advantage=advantages[b],
        )
        for b in range(len(out.tokens))
    ]
    return collate(samples, sum(len(s.tokens) for s in samples), device)
