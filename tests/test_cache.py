"""The compacting cache and the eviction trace it records."""

import numpy as np
import pytest
import torch

import kvrl.engines.hf as hf
from kvrl import kernels
from kvrl.cache import EvictionTrace, KVCache
from kvrl.engines.base import Sampling
from kvrl.envs.chains import ChainSpec, make_chain_task
from kvrl.kernels.reference import scores
from kvrl.kernels.reference.replay import NEVER
from kvrl.policies import Observation, make_policy

BUDGET, INTERVAL, WINDOW, SINK, NEW = 20, 4, 4, 2, 30


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    spec = ChainSpec(min_statements=4, max_statements=12, min_depth=1, max_depth=3)
    return [make_chain_task(rng, spec)["prompt"] for _ in range(4)]


def make(name, model, **kw):
    cfg = model.config
    extra = (
        dict(group=2, head_dim=cfg.head_dim, layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads)
        if name == "learned"
        else {}
    )
    return make_policy(name, **{"budget": BUDGET, "interval": INTERVAL, "window": WINDOW, "sink": SINK, **kw}, **extra)


def generate_keeping_cache(engine, batch, policy, monkeypatch):
    """generate(), also returning the KVCache it decoded with."""
    caches = []

    class Keep(KVCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            caches.append(self)

    monkeypatch.setattr(hf, "KVCache", Keep)
    out = engine.generate(batch, Sampling(max_new_tokens=NEW, ignore_eos=True), policy=policy)
    return out, caches[0]


def test_trace_dtype_save_load_and_slicing(tmp_path):
    death = torch.full((2, 2, 2, 10), NEVER, dtype=torch.int32)
    death[0, 0, 1, 3] = 5
    death[1, 1, 0, 0] = 8
    death[1, 1, 1, 2] = 12  # beyond T: no query of the trace is affected -> never
    trace = EvictionTrace.from_death(death, [10, 7], logprob=torch.randn(3, 2, 2, 2))
    assert trace.death.dtype == torch.int16 and trace.never == 32767
    expected = death.clone()
    expected[1, 1, 1, 2] = NEVER
    assert torch.equal(trace.full(), expected) and trace.full().dtype == torch.int32
    trace.save(tmp_path / "t.safetensors")
    back = EvictionTrace.load(tmp_path / "t.safetensors")
    assert back.death.dtype == torch.int16
    for a, b in [(back.death, trace.death), (back.lengths, trace.lengths), (back.logprob, trace.logprob)]:
        assert torch.equal(a, b)
    one = trace.for_sequence(1)  # length 7: the death at 8 affects no query of it
    assert one.death.shape == (2, 1, 2, 7) and (one.full() == NEVER).all()
    assert one.logprob.shape == (3, 2, 1, 2)
    long = EvictionTrace.from_death(torch.full((1, 1, 1, 40_000), NEVER, dtype=torch.int32), [40_000])
    assert long.death.dtype == torch.int32 and long.never == NEVER


def test_retention_counts_visible_query_key_pairs():
    death = torch.full((1, 1, 1, 4), NEVER, dtype=torch.int32)
    death[..., 0] = 2  # key 0 seen by queries 0, 1 only
    trace = EvictionTrace.from_death(death, [4])
    # causal pairs: 4 + 3 + 2 + 1 = 10, visible: 2 + 3 + 2 + 1 = 8
    assert trace.retention().shape == (1, 1, 1) and abs(float(trace.retention()) - 0.8) < 1e-6


def test_flex_block_mask_equals_dense_replay(engine, batch):
    """The flex-attention BlockMask replays a trace exactly like the dense reference."""
    out = engine.generate(batch, Sampling(max_new_tokens=12), policy=make("gkv", engine.model))
    seqs = [p + t for p, t in zip(out.prompt_ids, out.tokens)]
    S = max(map(len, seqs))
    ids = torch.tensor([[0] * (S - len(s)) + s for s in seqs])
    pos = torch.tensor([[-1] * (S - len(s)) + list(range(len(s))) for s in seqs])
    logits = {}
    attention = engine.model.config._attn_implementation
    engine.model.set_attn_implementation("kvrl_replay")  # the engine leaves the model's own
    try:
        with torch.no_grad():
            for flex in (False, True):
                logits[flex] = engine.model(
                    input_ids=ids, position_ids=pos.clamp(min=0), kvrl_replay=out.traces.replay(pos, flex=flex)
                ).logits
    finally:
        engine.model.set_attn_implementation(attention)
    real = pos >= 0
    torch.testing.assert_close(logits[True][real], logits[False][real], atol=1e-5, rtol=0)


def test_cache_holds_exactly_the_never_evicted_keys(engine, batch, monkeypatch):
    out, cache = generate_keeping_cache(engine, batch, make("gkv", engine.model), monkeypatch)
    death = out.traces.full()
    fed = cache.step_pos[:, -1] + 1  # positions written to the cache
    assert (out.traces.lengths == fed + 1).all(), "the last generated token is never fed"
    for layer, lay in enumerate(cache.layers):
        assert lay.keys.shape[2] <= BUDGET + INTERVAL
        for b in range(len(batch)):
            for h in range(lay.keys.shape[1]):
                held = set(lay.key_pos[b, h][lay.key_pos[b, h] >= 0].tolist())
                alive = set(torch.nonzero(death[layer, b, h, : fed[b]] == NEVER).flatten().tolist())
                assert held == alive, (layer, b, h)


def visible_and_evictions(d):
    """From one row's death times d [L, H, n]: the keys each query sees [n(queries), L, H]
    and the sorted eviction times."""
    n = d.shape[-1]
    k = torch.arange(n)
    q = torch.arange(n)[:, None, None, None]
    return ((k <= q) & (q < d)).sum(-1), sorted(set(d[d != NEVER].tolist()))


def test_eviction_counts_and_visible_keys_follow_the_schedule(engine, batch):
    """Each eviction leaves exactly BUDGET keys; between evictions a query sees at most
    BUDGET + INTERVAL; evictions happen only after prefill and every INTERVAL tokens."""
    out = engine.generate(batch, Sampling(max_new_tokens=NEW, ignore_eos=True), policy=make("snapkv", engine.model))
    death = out.traces.full().long()
    prompt = [len(p) for p in out.prompt_ids]
    assert max(prompt) > BUDGET
    n_events = 0
    for b, n in enumerate(out.traces.lengths.tolist()):
        d = death[:, b, :, :n]  # [L, H, n]
        visible, times = visible_and_evictions(d)
        assert all((t - prompt[b]) % INTERVAL == 0 for t in times), "evictions off schedule"
        if prompt[b] > BUDGET:
            assert times[0] == prompt[b], "a prompt longer than the budget is compressed right after prefill"
        for t in times:
            before = visible[t - 1]
            assert (before > BUDGET).all() and ((d == t).sum(-1) == before - BUDGET).all()
            assert (visible[t] == BUDGET + 1).all()  # the next query sees the kept keys and itself
        if times:
            assert (visible[times[0] :] <= BUDGET + INTERVAL).all()
            ret = out.traces.retention()[:, b]
            assert (ret < 1).all() and (ret > BUDGET / n).all()
        n_events += len(times)
    assert n_events >= 4 * len(batch) - 2


def test_heads_keep_different_sets(engine, batch, monkeypatch):
    out, cache = generate_keeping_cache(engine, batch, make("gkv", engine.model), monkeypatch)
    kp = torch.stack([lay.key_pos for lay in cache.layers])  # [L, B, H, N]
    assert not torch.equal(kp[:, :, 0], kp[:, :, 1])
    assert (out.traces.full()[:, :, 0] != out.traces.full()[:, :, 1]).any()


@pytest.mark.parametrize("name", ["gkv", "learned", "h2o"])
def test_policy_state_is_compacted_with_the_cache(engine, batch, monkeypatch, name):
    """The state a policy sees at an eviction is, for every surviving token, the state it
    returned for that token at the previous eviction (matched by true position), and NaN
    for tokens that arrived since."""
    policy = make(name, engine.model)
    calls = []
    score = policy.score

    def recording(obs):
        scores, state = score(obs)
        calls.append((obs.layer, obs.key_pos.clone(), None if obs.state is None else obs.state.clone(), state.clone()))
        return scores, state

    monkeypatch.setattr(policy, "score", recording)
    out, cache = generate_keeping_cache(engine, batch, policy, monkeypatch)
    L = len(cache.layers)
    assert len(calls) >= 3 * L
    final = [(layer, lay.key_pos, lay.state, None) for layer, lay in enumerate(cache.layers)]
    checked = 0
    for (layer, pos0, _, new0), (layer1, pos1, state1, _) in zip(calls, calls[L:] + final):
        assert layer == layer1
        for b in range(pos0.shape[0]):
            for h in range(pos0.shape[1]):
                before = {p: new0[b, h, j] for j, p in enumerate(pos0[b, h].tolist()) if p >= 0}
                for j, p in enumerate(pos1[b, h].tolist()):
                    if p < 0:
                        continue
                    if p in before:
                        torch.testing.assert_close(state1[b, h, j], before[p], equal_nan=True, atol=0, rtol=0)
                        checked += int(not before[p].isnan().all())
                    else:
                        assert state1[b, h, j].isnan().all()
    assert checked > 100


def test_ratio_mode_keeps_the_budget_of_each_length_and_rows_match_alone(engine, batch):
    """G-KV's ratio mode over prompts of different lengths: every eviction, at true length
    t (after prefill, then every INTERVAL tokens), leaves max(BUDGET, ⌊t/2⌋) keys; the rows
    of one eviction step keep different counts (the shorter ones are filled up to the
    longest and padded), and each row decodes exactly as it does alone."""
    policy = make("gkv", engine.model, budget_ratio=0.5)
    sampling = Sampling(max_new_tokens=NEW, ignore_eos=True)
    out = engine.generate(batch, sampling, policy=policy)
    death = out.traces.full().long()
    prompt = [len(p) for p in out.prompt_ids]
    assert len(set(prompt)) == len(batch)
    kept = {}  # eviction time -> keys kept, per row
    for b, n in enumerate(out.traces.lengths.tolist()):
        visible, times = visible_and_evictions(death[:, b, :, :n])
        assert times and all((t - prompt[b]) % INTERVAL == 0 for t in times), "evictions off schedule"
        for t in times:
            assert (visible[t] == max(BUDGET, t // 2) + 1).all(), (b, t)  # the next query: kept keys + itself
            kept.setdefault(t - prompt[b], []).append(max(BUDGET, t // 2))
        alone = engine.generate([batch[b]], sampling, policy=policy)
        assert alone.tokens[0] == out.tokens[b]
        np.testing.assert_allclose(alone.logprobs[0], out.logprobs[b], atol=1e-5)
        assert torch.equal(alone.trace(0).death, out.trace(b).death), b
    assert any(len(set(counts)) > 1 for counts in kept.values()), "no step where rows kept different counts"
    assert max(max(c) for c in kept.values()) > BUDGET, "the ratio never raised the budget"


@pytest.mark.parametrize("name,kw", [("rkv", {}), ("rkv", {"retain_direction": "first_vllm"}), ("gkv", {})])
def test_redundancy_picks_in_the_state_equal_the_full_computation(name, kw, monkeypatch):
    """R-KV and G-KV carry each slot's exempt row ("pick") in their state, so that an
    eviction compares only the new keys and those whose pick was evicted with the cache
    (:func:`~kvrl.kernels.reference.scores.key_redundancy_update`). Through the cache's own state
    threading (compaction, NaN for new tokens, a padded row kept within its budget at the
    first evictions), with near-duplicates planted so that picks exist and get evicted, every
    eviction's redundancy equals the stateless ``key_redundancy`` of that cache within 1e-6,
    its picks equal those of the full computation, and so do the policy's scores."""
    b, h, g, d, new = 2, 2, 2, 16, 56
    prompt = torch.tensor([40, 22])
    policy = make_policy(name, budget=32, interval=8, window=4, sink=1, **kw)
    direction, column = kw.get("retain_direction", "last"), 0 if name == "rkv" else 1
    calls, updated = [], scores._updated_picks
    monkeypatch.setattr(scores, "_updated_picks", lambda *a: calls.append(1) or updated(*a))
    counts = {"evictions": 0, "incremental": 0, "kept_pick": 0, "evicted_pick": 0}
    score = policy.score

    def checking(obs):
        before = len(calls)
        got_scores, state = score(obs)
        counts["incremental"] += len(calls) > before  # the policy's call took the incremental path
        valid = obs.key_pos >= 0
        previous = obs.state[..., column]
        red, pick = kernels.key_redundancy_update(
            obs.keys, obs.key_pos, previous, policy.threshold, retain_direction=direction
        )
        want = kernels.key_redundancy(obs.keys, valid, policy.threshold, retain_direction=direction)
        assert (red - want).abs().max() <= 1e-6
        blank = obs.state.clone()
        blank[..., column] = float("nan")  # no picks: the full computation
        want_scores, want_state = score(Observation(**{**vars(obs), "state": blank}))
        assert torch.equal(state[..., column].nan_to_num(-2), want_state[..., column].nan_to_num(-2))
        assert torch.equal(pick.nan_to_num(-2), want_state[..., column].nan_to_num(-2))
        assert (got_scores - want_scores)[valid].abs().max() <= 1e-6
        for p_row, prev_row in zip(obs.key_pos.flatten(0, 1).tolist(), previous.flatten(0, 1).tolist()):
            present = {p for p in p_row if p >= 0}
            picks = [q for p, q in zip(p_row, prev_row) if p >= 0 and q == q and q >= 0]
            counts["kept_pick"] += sum(q in present for q in picks)
            counts["evicted_pick"] += sum(q not in present for q in picks)
        counts["evictions"] += 1
        return got_scores, state

    monkeypatch.setattr(policy, "score", checking)
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(1, b, h, int(prompt.max()) + new, policy)
    pos = torch.arange(int(prompt.max())).expand(b, -1) - (prompt.max() - prompt)[:, None]
    pos = pos.masked_fill(pos < 0, -1)
    for generated in range(new + 1):
        q = pos.shape[1]
        keys = torch.randn(b, h, q, d, generator=gen)
        layer = cache.layers[0]
        old = keys[:, :, :20] if layer.keys is None else layer.keys
        src = torch.randint(0, old.shape[2], (b, h, q), generator=gen)
        copies = 2 * old.gather(2, src[..., None].expand(-1, -1, -1, d)) + 0.3 * torch.randn(b, h, q, d, generator=gen)
        dup = torch.rand(b, h, q, 1, generator=gen) < 0.5
        if layer.keys is None:
            dup[:, :, :20] = False  # the prompt's first 20 keys are the originals
        keys = torch.where(dup, copies, keys)
        cache.begin(pos, generated)
        cache.update(keys, torch.randn(b, h, q, d, generator=gen), 0)
        layer.observe_queries(torch.randn(b, h * g, q, d, generator=gen), pos)
        if cache.evict_now:
            cache.evict(0, d**-0.5)
        pos = pos[:, -1:] + 1
    assert counts["evictions"] >= 7 and counts["incremental"] >= 4
    assert counts["kept_pick"] > 100 and counts["evicted_pick"] > 10
