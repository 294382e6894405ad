"""KV policies: one contract matrix over every policy of the zoo and the variants reference
recipes need (shapes, what a score reads, selection, batch independence, ragged rows, sampled
selection, determinism). The hand-computed cases are in test_policies_formulas.py,
test_policies_redundancy.py and test_policies_schedule.py.
"""

import math

import pytest
import torch
from policy_cases import INVALID, POLICY_KWARGS, B, H, N, make_obs

from kvrl.policies import KVPolicy, Observation, make_policy

# Non-default knobs that reference recipes need, through the same contract.
VARIANTS = {
    "rkv_first_vllm": ("rkv", dict(budget=12, window=4, retain_direction="first_vllm", threshold=0.3)),
    # R-KV's rkv/utils.py with run_math.py's λ
    "rkv_fallback": ("rkv", dict(budget=12, window=4, fallback=True, mix_lambda=0.07)),
    "gkv_no_score_cache": ("gkv", dict(budget=12, window=4, kernel_size=5, mix_lambda=0.1, score_cache=False)),
}


@pytest.fixture(params=sorted(POLICY_KWARGS) + sorted(VARIANTS))
def policy(request) -> KVPolicy:
    name, kwargs = VARIANTS.get(request.param, (request.param, POLICY_KWARGS.get(request.param)))
    return make_policy(name, **kwargs)


def protected_slots(policy, key_pos_row):
    """Slots of the first `sink` and last `window` valid positions of one (b, h) row."""
    valid = [n for n in range(key_pos_row.shape[0]) if key_pos_row[n] >= 0]
    return set(valid[: policy.sink]) | set(valid[len(valid) - policy.window :])


# --- the contract, on every policy ---


def test_scores_and_state_shapes(policy):
    obs = make_obs(policy)
    scores, state = policy.score(obs)
    valid = obs.key_pos >= 0
    assert scores.shape == (B, H, N)
    assert torch.isfinite(scores[valid]).all()
    if policy.state_size == 0:
        assert state is None
        return
    assert state.shape == (B, H, N, policy.state_size)
    candidates = valid & ~policy.always_kept(obs.key_pos)
    assert torch.isfinite(state[candidates]).all()  # NaN inputs were resolved
    # no state at all means "no token has state yet"
    fresh = Observation(**{**vars(obs), "state": None})
    all_nan = Observation(**{**vars(obs), "state": torch.full_like(obs.state, float("nan"))})
    torch.testing.assert_close(policy.score(fresh)[0], policy.score(all_nan)[0])


def test_score_reads_only_what_it_declares(policy):
    """The vLLM engine passes None for the fields a policy's ``reads`` leaves out; a policy
    that read one anyway would fail here, or score differently (the layer: −1, rows of
    several layers)."""
    obs = Observation(**{**vars(make_obs(policy)), "layer": 0})
    assert policy.reads <= {"keys", "values", "queries", "layer"}
    sparse = Observation(**{**vars(obs), **{f: None for f in ("keys", "values", "queries") if f not in policy.reads}})
    if "layer" not in policy.reads:
        sparse.layer = -1
    scores, state = policy.score(obs)
    got, got_state = policy.score(sparse)
    assert torch.equal(got, scores)
    assert (state is None) == (got_state is None)
    if state is not None:
        torch.testing.assert_close(got_state, state, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(policy.select(sparse, got).keep, policy.select(obs, scores).keep)
    if type(policy).__name__ in ("H2O", "SnapKV", "RKV", "GKV", "StreamingLLM"):  # the engine's fast path
        assert "values" not in policy.reads


def check_selection(policy, obs, keep, scores=None):
    k = min(policy.budget, N)
    assert keep.shape == (B, H, k) and keep.dtype == torch.long
    for b in range(B):
        for h in range(H):
            row, pos = keep[b, h].tolist(), obs.key_pos[b, h]
            assert len(set(row)) == k
            kept_pos = pos[row]
            assert (kept_pos >= 0).all()  # enough valid slots exist
            assert (kept_pos[1:] > kept_pos[:-1]).all()  # ascending true position
            assert protected_slots(policy, pos) <= set(row)
            if scores is not None:  # deterministic: the best candidates
                cand = [n for n in range(N) if pos[n] >= 0 and n not in protected_slots(policy, pos)]
                kept_c = [n for n in cand if n in row]
                dropped = [n for n in cand if n not in row]
                assert min(scores[b, h, kept_c]) >= max(scores[b, h, dropped])


def test_select_contract(policy):
    obs = make_obs(policy)
    scores, _ = policy.score(obs)
    check_selection(policy, obs, policy.select(obs, scores).keep, scores)


def test_select_fills_with_invalid_slots_only_when_short(policy):
    obs = make_obs(policy, invalid=([], list(range(20)), [0, 1]))  # row 1: 8 valid < K = 12
    keep = policy.select(obs, policy.score(obs)[0]).keep
    for h in range(H):
        pos = obs.key_pos[1, h, keep[1, h]]
        assert (pos[:4] == -1).all()  # invalid slots sort first
        assert torch.equal(pos[4:], obs.key_pos[1, h, 20:])  # every valid slot, in order
    assert (obs.key_pos[0].gather(-1, keep[0]) >= 0).all()


def test_batch_independence(policy):
    """Each row scored and selected in a padded batch = that row alone without padding."""
    obs = make_obs(policy)
    scores, state = policy.score(obs)
    keep = policy.select(obs, scores).keep
    for b in range(B):
        slots = [n for n in range(N) if n not in INVALID[b]]
        alone = Observation(
            keys=obs.keys[b : b + 1, :, slots],
            values=obs.values[b : b + 1, :, slots],
            queries=obs.queries[b : b + 1],
            key_pos=obs.key_pos[b : b + 1, :, slots],
            query_pos=obs.query_pos[b : b + 1],
            layer=obs.layer,
            scaling=obs.scaling,
            state=None if obs.state is None else obs.state[b : b + 1, :, slots],
        )
        s1, st1 = policy.score(alone)
        torch.testing.assert_close(s1[0], scores[b, :, slots], rtol=1e-5, atol=1e-6)
        if state is not None:
            torch.testing.assert_close(st1[0], state[b, :, slots], rtol=1e-5, atol=1e-6, equal_nan=True)
        k1 = policy.select(alone, s1).keep
        assert torch.equal(alone.key_pos[0].gather(-1, k1[0]), obs.key_pos[b].gather(-1, keep[b]))


def test_ragged_rows_with_padded_queries_and_own_generators(policy):
    """What the vLLM engine hands a policy when several requests evict in one step: caches
    of different lengths padded at the end, observation windows that are not full yet padded
    at the front (position −1), one seeded generator per request. Each row scores, selects
    and samples exactly as it would alone, unpadded, with its own generator."""
    ends = (N, N - 3, N - 7)
    obs = make_obs(policy, invalid=([], list(range(ends[1], N)), list(range(ends[2], N))))
    w = policy.observe
    missing = (0, 2, w - 1)  # row b has not observed its first `missing[b]` queries yet
    qpos = obs.query_pos.clone()
    for b, m in enumerate(missing):
        qpos[b, :m] = -1
    obs = Observation(**{**vars(obs), "query_pos": qpos})
    scores, _ = policy.score(obs)
    keep = policy.select(obs, scores).keep
    sampled = policy.select(obs, scores, sample=True, generator=[torch.Generator().manual_seed(b) for b in range(B)])
    for b, (n, m) in enumerate(zip(ends, missing)):
        alone = Observation(
            keys=obs.keys[b : b + 1, :, :n],
            values=obs.values[b : b + 1, :, :n],
            queries=obs.queries[b : b + 1, :, m:],
            key_pos=obs.key_pos[b : b + 1, :, :n],
            query_pos=obs.query_pos[b : b + 1, m:],
            layer=obs.layer,
            scaling=obs.scaling,
            state=None if obs.state is None else obs.state[b : b + 1, :, :n],
        )
        s1, _ = policy.score(alone)
        torch.testing.assert_close(s1[0], scores[b, :, :n], rtol=1e-5, atol=1e-6)
        assert torch.equal(policy.select(alone, s1).keep[0], keep[b])
        one = policy.select(alone, s1, sample=True, generator=torch.Generator().manual_seed(b))
        assert torch.equal(one.keep[0], sampled.keep[b])
        torch.testing.assert_close(one.logprob[0], sampled.logprob[b])


def sequential_logprob(scores, candidates, evicted):
    """Draw by draw: log softmax(-scores) over the candidates not drawn yet."""
    remaining = set(candidates)
    total = 0.0
    for e in evicted:
        x = {n: -float(scores[n]) for n in remaining}
        total += x[e] - math.log(sum(math.exp(v) for v in x.values()))
        remaining.remove(e)
    return total


def test_sampled_selection(policy):
    obs = make_obs(policy)
    scores, _ = policy.score(obs)
    sel = policy.select(obs, scores, sample=True, generator=torch.Generator().manual_seed(3))
    check_selection(policy, obs, sel.keep)
    assert sel.logprob.shape == (B, H) and torch.isfinite(sel.logprob).all()
    for b in range(B):
        for h in range(H):
            pos = obs.key_pos[b, h]
            valid = {n for n in range(N) if pos[n] >= 0}
            cand = valid - protected_slots(policy, pos)
            ev = [e for e in sel.evicted[b, h].tolist() if e >= 0]
            assert len(ev) == len(valid) - policy.budget
            assert set(ev) <= cand and set(ev).isdisjoint(sel.keep[b, h].tolist())
            assert set(ev) | set(sel.keep[b, h].tolist()) == valid
            want = sequential_logprob(scores[b, h].detach(), cand, ev)
            assert sel.logprob[b, h].item() == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_determinism(policy):
    obs = make_obs(policy)
    s1, st1 = policy.score(obs)
    s2, st2 = policy.score(obs)
    assert torch.equal(s1, s2)
    if st1 is not None:
        torch.testing.assert_close(st1, st2, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(policy.select(obs, s1).keep, policy.select(obs, s2).keep)
    draw = [policy.select(obs, s1, sample=True, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(draw[0].keep, draw[1].keep) and torch.equal(draw[0].logprob, draw[1].logprob)


def test_learned_scorer_logprob_has_gradients():
    policy = make_policy("learned", **POLICY_KWARGS["learned"])
    obs = make_obs(policy)
    sel = policy.select(obs, policy.score(obs)[0], sample=True, generator=torch.Generator().manual_seed(0))
    sel.logprob.sum().backward()
    grads = [p.grad for p in policy.scorer.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert policy.scorer.w1.grad[obs.layer].abs().sum() > 0 and policy.scorer.w1.grad[0].abs().sum() == 0
