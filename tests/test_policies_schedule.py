"""When and how much KV policies keep: the eviction schedule, ratio mode (each row's own budget),
head allocation, the regime a policy names, the window, parameter errors that name the
parameter, and the Plackett-Luce log-probability of a sampled selection.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from policy_cases import POLICY_KWARGS, make_obs

from kvrl.policies import (
    GKV,
    H2O,
    RKV,
    Evicting,
    Full,
    HeadAllocation,
    Mixed,
    Observation,
    Static,
    StreamingLLM,
    Window,
    as_regime,
    checksum,
    make_policy,
    plackett_luce_logprob,
    should_evict,
)


def test_should_evict_schedule():
    policy = StreamingLLM(budget=8, interval=4, window=2)
    assert should_evict(0, 9, policy, 9)  # a long prompt is compressed right after prefill
    assert not should_evict(0, 8, policy, 8)  # ... only when it exceeds the budget
    assert not should_evict(3, 11, policy, 12)
    assert should_evict(8, 12, policy, 17)


def test_budget_at_is_gkv_ratio_mode():
    """G-KV ``ScoreBasedKV.update_kv``, compress_mode="ratio": ``int(cur_len * r)`` when
    ``budget / cur_len < r``, else ``budget`` (score_based.py @345e290)."""
    small = dict(budget=8, window=2, sink=1)
    fixed, ratio = StreamingLLM(**small), StreamingLLM(**small, budget_ratio=0.25)
    assert [fixed.budget_at(n) for n in (5, 40, 1000)] == [8, 8, 8]
    assert [ratio.budget_at(n) for n in (5, 32, 35, 36, 40, 1000)] == [8, 8, 8, 9, 10, 250]
    assert ratio.budget_at(torch.tensor([5, 36, 1000])).tolist() == [8, 9, 250]
    assert fixed.budget_at(torch.tensor([5, 1000])).tolist() == [8, 8]
    # the reference's float product, not exact arithmetic: 0.29·100 = 28.999999999999996
    assert StreamingLLM(**small, budget_ratio=0.29).budget_at(100) == 28
    for r in (0.1, 0.2, 0.29, 1 / 3, 0.7, 1.0):
        policy = StreamingLLM(**small, budget_ratio=r)
        lengths = list(range(1, 400))
        want = [int(n * r) if 8 / n < r else 8 for n in lengths]
        assert [policy.budget_at(n) for n in lengths] == want, r
        assert policy.budget_at(torch.tensor(lengths)).tolist() == want, r
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="budget_ratio"):
            StreamingLLM(**small, budget_ratio=bad)


def test_ratio_mode_schedule_by_hand():
    """budget 6, ratio 0.5, interval 4, prompt 10: cut after prefill to max(6, 5) = 6,
    then at true lengths 14, 18, 22, 26 to 7, 9, 11, 13 (window and sink inside)."""
    from kvrl.engines.vllm.evicting import cache_len_after  # imports no vLLM

    policy = StreamingLLM(budget=6, interval=4, window=2, sink=1, budget_ratio=0.5)
    prompt = 10
    want = {
        10: 6,
        11: 7,
        12: 8,
        13: 9,
        14: 7,
        15: 8,
        16: 9,
        17: 10,
        18: 9,
        19: 10,
        20: 11,
        21: 12,
        22: 11,
        23: 12,
        24: 13,
        25: 14,
        26: 13,
    }
    n, got, cuts = prompt, {}, []
    for m in range(prompt, 27):  # the forward that brings the true length to m wrote one token (prefill: 10)
        if m > prompt:
            n += 1
        if should_evict(m - prompt, n, policy, m):
            key_pos = torch.arange(m - n, m)  # StreamingLLM keeps the newest: contiguous after a cut...
            key_pos[0] = 0  # ... but the sink
            obs = Observation(
                keys=torch.randn(1, 1, n, 4),
                values=torch.randn(1, 1, n, 4),
                queries=torch.randn(1, 1, 2, 4),
                key_pos=key_pos.view(1, 1, n),
                query_pos=torch.tensor([[m - 2, m - 1]]),
                state=None,
                layer=0,
                scaling=0.5,
            )
            sel = policy.select(obs, policy.score(obs)[0])
            assert sel.count.tolist() == [sel.keep.shape[-1]]
            cuts.append((m, key_pos[sel.keep[0, 0]].tolist()))
            n = sel.keep.shape[-1]
        got[m] = n
        assert cache_len_after(m, prompt, policy) == want[m], m
    assert got == want
    assert cuts[0] == (10, [0, 5, 6, 7, 8, 9])  # sink + the 5 newest of the prompt
    assert cuts[1] == (14, [0, 8, 9, 10, 11, 12, 13])  # budget_at(14) = 7
    assert [m for m, _ in cuts] == [10, 14, 18, 22, 26]


@pytest.mark.parametrize("ratio", [None, 0.5])
def test_schedule_of_many_rows_at_once(ratio):
    """The vLLM engine plans every row of a step at once: cache_len_after and should_evict on
    tensors of rows give what they give row by row, chunked prefill (m < prompt) included."""
    from kvrl.engines.vllm.evicting import cache_len_after

    policy = StreamingLLM(budget=6, interval=4, window=2, sink=1, budget_ratio=ratio)
    prompt, m = torch.meshgrid(torch.arange(1, 15), torch.arange(0, 40), indexing="ij")
    prompt, m = prompt.flatten(), m.flatten()
    clen = cache_len_after(m, prompt, policy)
    assert clen.tolist() == [cache_len_after(a, p, policy) for a, p in zip(m.tolist(), prompt.tolist())]
    due = should_evict(m - prompt, clen + 1, policy, m)
    assert due.dtype == torch.bool and due.any() and not due.all()
    assert due.tolist() == [
        bool(should_evict(a - p, c + 1, policy, a)) for a, p, c in zip(m.tolist(), prompt.tolist(), clen.tolist())
    ]


def test_ratio_mode_rows_of_a_batch_keep_their_own_budget():
    """Row 0 (true length 14) keeps max(6, 7) = 7 slots, row 1 (length 10, 4 padding slots)
    keeps 6: its keep is filled up to K = 7 with a slot it does not keep."""
    policy = StreamingLLM(budget=6, window=2, sink=1, budget_ratio=0.5)
    key_pos = torch.stack([torch.arange(14), torch.tensor([-1] * 4 + list(range(10)))]).view(2, 1, 14)
    obs = Observation(
        keys=torch.randn(2, 1, 14, 4),
        values=torch.randn(2, 1, 14, 4),
        queries=torch.randn(2, 1, 2, 4),
        key_pos=key_pos,
        query_pos=torch.tensor([[12, 13], [8, 9]]),
        state=None,
        layer=0,
        scaling=0.5,
    )
    for sample in (False, True):
        sel = policy.select(obs, policy.score(obs)[0], sample=sample, generator=torch.Generator().manual_seed(0))
        assert sel.keep.shape == (2, 1, 7) and sel.count.tolist() == [7, 6]
        assert key_pos[0, 0, sel.keep[0, 0]].tolist() == [0, 8, 9, 10, 11, 12, 13]
        if not sample:  # the sampled draw evicts at random; its kept count is what matters
            assert key_pos[1, 0, sel.keep[1, 0, :6]].tolist() == [0, 5, 6, 7, 8, 9]
        assert (key_pos[1, 0, sel.keep[1, 0, :6]] >= 0).all()
        assert sel.keep[1, 0, 6] not in sel.keep[1, 0, :6]  # the fill
    sel = policy.select(obs, policy.score(obs)[0], sample=True, generator=[torch.Generator().manual_seed(0)] * 2)
    assert (sel.evicted[1] >= 0).sum() == 10 - 6 and (sel.evicted[0] >= 0).sum() == 14 - 7


def test_gkv_ratio_budget_counts_each_rows_own_length():
    """G-KV's ratio mode takes ``cur_len``, the padded width of its batch, for every row:
    ``int(40 · 0.5) = 20`` for both rows below, so its 24-token row would keep 20 tokens
    (padding goes first). kvrl takes each row's own true length: 20 for the 40-token row,
    ``max(8, ⌊24 · 0.5⌋) = 12`` for the 24-token one (16 left-padding slots), the budget
    that row gets alone (G-KV's too at batch size 1)."""
    n, w = 40, 4
    policy = GKV(budget=8, window=w, budget_ratio=0.5)
    key_pos = torch.stack([torch.arange(n), torch.tensor([-1] * 16 + list(range(24)))]).view(2, 1, n)
    g = torch.Generator().manual_seed(0)
    obs = Observation(
        keys=torch.randn(2, 1, n, 8, generator=g),
        values=torch.randn(2, 1, n, 8, generator=g),
        queries=torch.randn(2, 2, w, 8, generator=g),
        key_pos=key_pos,
        query_pos=torch.tensor([[36, 37, 38, 39], [20, 21, 22, 23]]),
        state=None,
        layer=0,
        scaling=0.5,
    )
    sel = policy.select(obs, policy.score(obs)[0])
    assert sel.count.tolist() == [20, 12]  # G-KV: [20, 20]
    short = key_pos[1, 0, sel.keep[1, 0, :12]]
    assert (short >= 0).all() and short[-w:].tolist() == [20, 21, 22, 23]
    alone = Observation(
        keys=obs.keys[1:, :, 16:],
        values=obs.values[1:, :, 16:],
        queries=obs.queries[1:],
        key_pos=key_pos[1:, :, 16:],
        query_pos=obs.query_pos[1:],
        state=None,
        layer=0,
        scaling=0.5,
    )
    sel_alone = policy.select(alone, policy.score(alone)[0])
    assert sel_alone.count.tolist() == [12]
    assert alone.key_pos[0, 0, sel_alone.keep[0, 0]].tolist() == short.tolist()  # as if alone


def test_foresight_training_action_refuses_ratio_mode():
    policy = make_policy("learned", **{**POLICY_KWARGS["learned"], "budget_ratio": 0.5})
    obs = make_obs(policy)
    scores, _ = policy.score(obs)
    assert policy.select(obs, scores).count.tolist() == [20, 20, 20]  # inference: max(12, ⌊0.5·40⌋), N = 28
    with pytest.raises(ValueError, match="budget_ratio=0.5: ForesightKV's training action"):
        policy.act(obs.key_pos, scores)


@pytest.mark.parametrize("sparsity,count", [(0.0, 0), (0.1, 1), (0.25, 3), (0.5, 6), (0.55, 7), (1.0, 12)])
def test_head_allocation_count_and_global_ranking(sparsity, count):
    gates = torch.tensor([[0.9, 0.1, 0.5], [0.3, 0.8, 0.05], [0.7, 0.2, 0.6], [0.95, 0.4, 0.35]])
    mask = HeadAllocation(gates=gates, sparsity=sparsity, layers=4, kv_heads=3).compressed_mask()
    assert mask.shape == (4, 3) and mask.dtype == torch.bool
    assert int(mask.sum()) == count  # round(s·L·H), e.g. 0.55·12 = 6.6 -> 7
    if 0 < count < 12:  # a global threshold, not per layer
        assert gates[mask].max() < gates[~mask].min()


def test_head_allocation_ties_and_death():
    alloc = HeadAllocation(gates=torch.ones(2, 2), sparsity=0.5, layers=2, kv_heads=2, sink=2, recent=3)
    mask = alloc.compressed_mask()
    assert mask.tolist() == [[True, True], [False, False]]  # equal gates: lower index first
    death = alloc.death(8)
    never = torch.iinfo(torch.int32).max
    assert death.shape == (2, 2, 8) and death.dtype == torch.int32
    assert death[0, 0].tolist() == [never, never, 5, 6, 7, 8, 9, 10]  # k + recent for k >= sink
    assert (death[1] == never).all()


def test_as_regime_names_what_the_cache_does():
    policy = make_policy("h2o", budget=16, window=4)
    alloc = HeadAllocation(gates=torch.ones(2, 2), sparsity=0.5, layers=2, kv_heads=2, sink=2, recent=3)
    death = torch.full((2, 1, 2, 8), torch.iinfo(torch.int32).max, dtype=torch.int32)
    mixed = Mixed(torch.ones(2, 2), sink=2, recent=3)
    assert as_regime(None) == Full()
    assert isinstance(as_regime(policy), Evicting) and as_regime(policy).policy is policy
    assert isinstance(as_regime(alloc), Static) and as_regime(alloc).pattern is alloc
    assert isinstance(as_regime(death), Static) and as_regime(death).pattern is death
    assert as_regime(mixed) is mixed and as_regime(Full()) == Full()
    with pytest.raises(TypeError, match="unsupported cache regime"):
        as_regime("gkv")


def test_regime_state_round_trips_and_refuses_mismatches():
    geometry = dict(group=2, head_dim=8, layers=2, kv_heads=2)
    assert Full().state() == {} and Evicting(make_policy("h2o", budget=16, window=4)).state() == {}
    learned = Evicting(make_policy("learned", budget=200, seed=0, **geometry))
    other = Evicting(make_policy("learned", budget=200, seed=1, **geometry))
    state = learned.state()
    assert set(state) == set(learned.policy.scorer.state_dict())
    assert checksum(other.state()) != checksum(state)
    other.load_state(state)
    assert checksum(other.state()) == checksum(state)
    mixed = Mixed(torch.ones(2, 2))
    mixed.load_state({"gates": torch.full((2, 2), 0.5)})
    assert torch.equal(mixed.state()["gates"], torch.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="shape"):
        mixed.load_state({"gates": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="holds"):
        mixed.load_state(state)
    with pytest.raises(ValueError, match="holds"):
        Full().load_state({"gates": torch.zeros(2, 2)})


def test_window_is_sink_recent_on_every_head():
    never = torch.iinfo(torch.int32).max
    death = Static(Window(sink=2, recent=3, layers=2, kv_heads=2)).death(8, 3)
    assert death.shape == (2, 3, 2, 8) and death.dtype == torch.int32
    assert (death == death[0, 0, 0]).all() and death[1, 2, 1].tolist() == [never, never, 5, 6, 7, 8, 9, 10]
    assert torch.equal(Static(death).row(1, 8), death[:, 1])
    with pytest.raises(ValueError, match="covers 8 positions"):
        Static(death).death(9, 3)
    with pytest.raises(ValueError, match="3 sequences"):
        Static(death).death(8, 2)


@pytest.mark.parametrize(
    "build,param",
    [
        (lambda: H2O(budget=8, window=8), "budget"),
        (lambda: GKV(budget=20, window=16, sink=4), "budget"),
        (lambda: RKV(budget=64, interval=0), "interval"),
        (lambda: GKV(budget=64, mode="median"), "mode"),
        (lambda: GKV(budget=64, threshold=-0.1), "threshold"),
        (lambda: RKV(budget=64, threshold=1.5), "threshold"),
        (lambda: RKV(budget=64, retain_direction="middle"), "retain_direction"),
        (lambda: make_policy("snapkv", budget=64, kernel_size=4), "kernel_size"),
        (lambda: make_policy("learned", budget=200, group=0, head_dim=8, layers=1, kv_heads=1), "group"),
        (lambda: HeadAllocation(gates=torch.ones(2, 4), sparsity=1.5, layers=2, kv_heads=4), "sparsity"),
        (lambda: make_policy("lru", budget=64), "streaming, h2o, snapkv, rkv, gkv, learned"),
    ],
)
def test_bad_parameters_name_the_parameter(build, param):
    with pytest.raises(ValueError, match=param):
        build()


def test_head_allocation_gates_shape_error_names_both_shapes():
    with pytest.raises(ValueError, match=r"gates.*\(3, 4\).*\(2, 4\)"):
        HeadAllocation(gates=torch.ones(3, 4), sparsity=0.5, layers=2, kv_heads=4)


def test_plackett_luce_logprob_brute_force():
    """4 candidates, 2 evicted: the logprob of each ordered draw, and the sampler's frequencies."""
    scores = torch.tensor([0.0, 0.3, -0.5, 1.2, 0.7, 0.0])  # slots 0 (sink) and 5 (window) protected
    x = -scores.numpy()[1:5].astype(np.float64)
    prob = {}
    for i, j in itertools.permutations(range(4), 2):
        p_i = math.exp(x[i]) / np.exp(x).sum()
        prob[i + 1, j + 1] = p_i * math.exp(x[j]) / (np.exp(x).sum() - math.exp(x[i]))
    assert sum(prob.values()) == pytest.approx(1.0)
    candidates = torch.tensor([False, True, True, True, True, False])
    for (i, j), p in prob.items():
        got = plackett_luce_logprob(scores.view(1, 1, 6), candidates.view(1, 1, 6), torch.tensor([[[i, j]]]))
        assert got.item() == pytest.approx(math.log(p), rel=1e-6)

    rows = 4000
    policy = StreamingLLM(budget=4, sink=1, window=1)
    obs = Observation(
        keys=torch.zeros(rows, 1, 6, 1),
        values=torch.zeros(rows, 1, 6, 1),
        queries=torch.zeros(rows, 1, 1, 1),
        key_pos=torch.arange(6).expand(rows, 1, 6),
        query_pos=torch.full((rows, 1), 5),
        state=None,
        layer=0,
        scaling=1.0,
    )
    sel = policy.select(obs, scores.expand(rows, 1, 6), sample=True, generator=torch.Generator().manual_seed(0))
    drawn = [tuple(r) for r in sel.evicted[:, 0].tolist()]
    for pair, p in prob.items():
        freq = drawn.count(pair) / rows
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / rows) + 1e-3
    lp = {pair: math.log(p) for pair, p in prob.items()}
    np.testing.assert_allclose(sel.logprob[:, 0].numpy(), [lp[d] for d in drawn], rtol=1e-5)
