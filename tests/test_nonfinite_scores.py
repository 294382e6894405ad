"""A policy's NaN or ±inf keep-scores stop the engine that evicts with them, named
(:func:`kvrl.policies.evict.check_scores`), and ForesightKV's training draws (``LearnedScorer.act``);
the vLLM engine's case is in test_vllm_engine.py."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvrl.engines.base import Sampling
from kvrl.kernels.reference.replay import NEVER
from kvrl.policies import KVPolicy, make_policy
from kvrl.policies.base import Observation
from kvrl.policies.evict import check_scores

BUDGET, INTERVAL, WINDOW, SINK = 12, 4, 4, 2
PROMPTS = ["3 1 4 1 5 9 2 6 5 3 5 8 9 7 9 3 2 3 8 4 6 ;", "2 7 1 8 2 8 1 8 2 8 4 5 9 0 4 5 ;"]


@dataclass(kw_only=True)
class BrokenAt(KVPolicy):
    """A user's policy: KNorm's scores, with ``value`` at layer ``layer`` on the candidates
    (``protected=False``) or on the sink and window alone (``protected=True``), which select()
    never ranks."""

    layer: int = 1
    value: float = float("nan")
    protected: bool = False
    reads: ClassVar[frozenset[str]] = frozenset({"keys", "layer"})

    def score(self, obs: Observation) -> tuple[torch.Tensor, None]:
        scores = -obs.keys.float().norm(dim=-1)
        if obs.layer != self.layer:
            return scores, None
        kept = self.always_kept(obs.key_pos)
        return scores.masked_fill(kept if self.protected else ~kept, self.value), None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scores_stop_generate_naming_the_policy_layer_and_position(engine, value):
    policy = BrokenAt(budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK, value=value)
    with pytest.raises(ValueError, match=r"BrokenAt\.score\(\) returned .* at layer 1, batch row 0, .*after position"):
        engine.generate(PROMPTS, Sampling(max_new_tokens=8), policy=policy)
    with pytest.raises(ValueError, match="BrokenAt"):  # sampled evictions too (RL's rollouts)
        engine.generate(PROMPTS, Sampling(max_new_tokens=8, temperature=1.0, sample_evictions=True), policy=policy)


def test_scores_select_never_ranks_may_be_anything(engine):
    """NaN at the sink and window (and at padding) is no error: they are kept whatever they score."""
    policy = BrokenAt(budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK, protected=True)
    out = engine.generate(PROMPTS, Sampling(max_new_tokens=8), policy=policy)
    assert (out.traces.full() < NEVER).any(), "the policy evicted"


def test_a_learned_scorer_with_huge_finite_weights_is_stopped(engine):
    """Weights of 3e38 are finite (a weight check passes them), the scores they give are not."""
    policy = make_policy("learned", engine.model.config, budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    with torch.no_grad():
        for p in policy.scorer.parameters():
            p.fill_(3e38)
    assert all(bool(p.isfinite().all()) for p in policy.scorer.parameters())
    with pytest.raises(ValueError, match=r"LearnedScorer\.score\(\) returned .* at layer 0.*check its weights"):
        engine.generate(PROMPTS, Sampling(max_new_tokens=8), policy=policy)


@pytest.mark.parametrize("sample", [True, False], ids=["training_draw", "greedy"])
def test_foresight_training_draws_stop_at_non_finite_scores(engine, sample):
    """ForesightKV's eviction MDP draws through ``LearnedScorer.act``, not ``evict()``: the same check, there.
    A NaN on the sink (never a candidate) is let through."""
    policy = make_policy("learned", engine.model.config, budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    n, heads = BUDGET + INTERVAL, 2
    key_pos = torch.arange(n).expand(1, heads, n)
    scores = torch.randn(1, heads, n)
    sink = scores.clone()
    sink[0, 1, 0] = float("nan")
    assert policy.act(key_pos, sink, sample=sample).drawn.sum() == 2 * INTERVAL
    scores[0, 1, SINK + 3] = float("nan")
    with pytest.raises(ValueError, match=rf"non-finite .* KV head 1, key position {SINK + 3}.*lower trainer\.lr"):
        policy.act(key_pos, scores, sample=sample)


def test_rows_of_several_layers_are_named_by_their_own_layer():
    """The vLLM worker scores a few layers in one call (rows layer-major, ``obs.layer`` = −1):
    the error names the bad row's layer and its row within that layer."""
    rows, heads, n = 4, 2, 20
    key_pos = torch.arange(n).expand(rows, heads, n).clone()
    obs = Observation(None, None, None, key_pos, torch.full((rows, WINDOW), -1), None, -1, 1.0)
    policy = BrokenAt(budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    scores = torch.zeros(rows, heads, n)
    check_scores(policy, obs, scores, layers=[6, 7])
    scores[3, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="at layer 7, batch row 1, KV head 1, key position 5, .* after position 19"):
        check_scores(policy, obs, scores, layers=[6, 7])
