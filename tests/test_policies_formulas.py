"""KV policies' scores computed by hand: GQA pooling, G-KV's global score (with and without its
score cache, its SnapKV setting, without normalisation), H2O's accumulation across evictions,
the learned scorer's features and StreamingLLM's sink and recent tokens.

Expected values are worked out here with NumPy from the formulas in the papers and reference
code (docs/fidelity.md), never by calling the code under test.
"""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from policy_cases import make_obs, softmax

from kvrl.kernels import gather_slots, window_attention
from kvrl.policies import GKV, H2O, LearnedScorer, Observation, StreamingLLM, make_policy, should_evict


def test_gqa_pooling_order():
    """One KV head, two query heads with opposite preferences, keys k0 = 2, k1 = 0."""
    q = torch.tensor([[1.0], [-1.0]]).view(1, 2, 1, 1)  # [B, Hq, W, D]
    k = torch.tensor([[2.0], [0.0]]).view(1, 1, 2, 1)
    pos, qpos = torch.tensor([[[0, 1]]]), torch.tensor([[1]])
    hi, lo = math.exp(2) / (math.exp(2) + 1), 1 / (math.exp(2) + 1)  # 0.8808, 0.1192
    # G-KV: softmax per head [hi, lo] and [lo, hi], then max -> [hi, hi]
    got = window_attention(q, k, pos, qpos, 1.0, gqa="max", order="softmax_then_pool")
    torch.testing.assert_close(got.flatten(), torch.tensor([hi, hi]))
    # R-KV: max of logits [2, 0] and [-2, 0] -> [2, 0], then softmax -> [hi, lo]
    got = window_attention(q, k, pos, qpos, 1.0, gqa="max", order="pool_then_softmax")
    torch.testing.assert_close(got.flatten(), torch.tensor([hi, lo]))
    got = window_attention(q, k, pos, qpos, 1.0, gqa="mean", order="softmax_then_pool")
    torch.testing.assert_close(got.flatten(), torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("mode", ["max", "mean", "sum"])
def test_gkv_global_score_two_steps(mode):
    alpha, scale = 0.8, 1 / math.sqrt(2)
    policy = GKV(budget=3, window=1, interval=2, mix_lambda=1.0, alpha=alpha, mode=mode)
    qh = np.array([[1.0, 0.5], [-0.5, 1.0]])  # two query heads of one KV head

    def local_score(keys, q, n_cand):
        # softmax per query head over all keys (window included), max over the group,
        # window column dropped, mean over the single query, / max over candidates
        a = np.max([softmax(keys @ qh_g * scale) for qh_g in q], axis=0)[:n_cand]
        return a / a.max()

    # step 1: prompt positions 0..4, query at 4; no state -> F = S in every mode
    k1 = np.array([[1, 0], [0, 1], [1, 1], [-1, 0], [0.5, 0.5]])
    s1 = local_score(k1, qh, 4)
    obs1 = Observation(
        keys=torch.tensor(k1, dtype=torch.float32).view(1, 1, 5, 2),
        values=torch.zeros(1, 1, 5, 2),
        queries=torch.tensor(qh, dtype=torch.float32).view(1, 2, 1, 2),
        key_pos=torch.arange(5).view(1, 1, 5),
        query_pos=torch.tensor([[4]]),
        state=None,
        layer=0,
        scaling=scale,
    )
    score1, state1 = policy.score(obs1)
    np.testing.assert_allclose(score1[0, 0, :4].numpy(), s1, rtol=1e-6)
    np.testing.assert_allclose(state1[0, 0, :4, 0].numpy(), s1, rtol=1e-6)
    assert state1[0, 0, 4].isnan().all()  # the window token keeps no F
    keep = policy.select(obs1, score1).keep  # best two candidates + the window slot 4
    top2 = sorted(np.argsort(-s1)[:2].tolist())
    assert keep[0, 0].tolist() == top2 + [4]

    # step 2: two new tokens (positions 5, 6) appended with NaN state; query at 6
    k_new = np.array([[0.0, -1.0], [1.0, -1.0]])
    k2 = np.concatenate([k1[top2 + [4]], k_new])
    q2 = qh[::-1].copy()
    state2 = torch.cat([gather_slots(state1, keep), torch.full((1, 1, 2, 1), float("nan"))], 2)
    obs2 = Observation(
        keys=torch.tensor(k2, dtype=torch.float32).view(1, 1, 5, 2),
        values=torch.zeros(1, 1, 5, 2),
        queries=torch.tensor(q2, dtype=torch.float32).view(1, 2, 1, 2),
        key_pos=torch.tensor([top2 + [4, 5, 6]]).view(1, 1, 5),
        query_pos=torch.tensor([[6]]),
        state=state2,
        layer=0,
        scaling=scale,
    )
    s2 = local_score(k2, q2, 4)
    old = np.array([s1[top2[0]], s1[top2[1]], np.nan, np.nan])  # positions 4, 5: no F yet
    if mode == "max":
        want = np.maximum(alpha * np.where(np.isnan(old), s2, old), s2)
    elif mode == "mean":
        want = alpha * np.where(np.isnan(old), s2, old) + (1 - alpha) * s2
    else:
        want = alpha * np.nan_to_num(old) + s2
    score2, new_state = policy.score(obs2)
    np.testing.assert_allclose(score2[0, 0, :4].numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(new_state[0, 0, :4, 0].numpy(), want, rtol=1e-6)


def test_gkv_without_score_cache():
    """score_cache=False (the reference without --enable_score_cache, its "R-KV" recipe):
    λ·maxpool(S) − (1−λ)·R with S and R unnormalised and no smoothing; the state is ignored."""
    lam, scale = 0.1, 0.5
    keys = np.array(
        [
            [1.0, 0, 0, 0],
            [0.6, 0.8, 0, 0],
            [0, 1, 0, 0],
            [0, 0, 1, 0],
            [0, 0.6, 0.8, 0],
            [0, 0, 0, 1],
            [0.5, 0.5, 0.5, 0.5],
        ]
    )
    queries = np.array([[[1.0, 0.5, -0.5, 0.0]], [[-0.5, 1.0, 0.0, 0.5]]])  # [Hq = 2, W = 1, D]
    # S: softmax per query head over all 7 keys, max over the 2 heads, the window slot 6 dropped
    s = np.max([softmax(keys @ q[0] * scale) for q in queries], axis=0)[:6]
    pooled = np.array([s[max(0, i - 1) : i + 2].max() for i in range(6)])  # max_pool1d(3) over candidates
    cos = (keys / np.linalg.norm(keys, axis=1, keepdims=True)) @ (keys / np.linalg.norm(keys, axis=1, keepdims=True)).T
    np.fill_diagonal(cos, 0.0)
    # Near-duplicates (cos > 0.5): (0, 1) 0.6, (1, 2) 0.8, (1, 6) 0.7, (2, 4) 0.6, (3, 4) 0.8,
    # (4, 6) 0.7; the window key 6 has cos 0.5 with 0, 2, 3, 5: not above (eps makes it 0.499999).
    # Latest rows: col 0 <- 1, col 1 <- 6 (of 0, 2, 6), col 2 <- 4, col 3 <- 4, col 4 <- 6, col 6 <- 4.
    for m, n in [(1, 0), (6, 1), (4, 2), (4, 3), (6, 4), (4, 6)]:
        cos[m, n] = 0.0
    np.testing.assert_allclose(cos.sum(1), [1.1, 1.98, 1.9, 1.3, 0.48, 0.5, 2.0], atol=1e-12)
    red = softmax(cos.sum(1) / 7)[:6]
    want = lam * pooled - (1 - lam) * red
    policy = GKV(budget=4, window=1, mix_lambda=lam, kernel_size=3, score_cache=False)
    obs = Observation(
        keys=torch.tensor(keys, dtype=torch.float32).view(1, 1, 7, 4),
        values=torch.zeros(1, 1, 7, 4),
        queries=torch.tensor(queries, dtype=torch.float32).view(1, 2, 1, 4),
        key_pos=torch.arange(7).view(1, 1, 7),
        query_pos=torch.tensor([[6]]),
        state=None,
        layer=0,
        scaling=scale,
    )
    scores, state = policy.score(obs)
    np.testing.assert_allclose(scores[0, 0, :6].numpy(), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state[0, 0, :6, 0].numpy(), s, rtol=1e-5)  # F = S, unnormalised
    f_old = torch.linspace(5, 1, 7).view(1, 1, 7, 1)  # a stored F, and no picks (NaN)
    stale = Observation(**{**vars(obs), "state": torch.cat([f_old, torch.full_like(f_old, float("nan"))], -1)})
    torch.testing.assert_close(policy.score(stale)[0], scores)  # no smoothing with a stored F
    cached = GKV(budget=4, window=1, mix_lambda=lam, kernel_size=3)
    assert not torch.allclose(cached.score(stale)[0], cached.score(obs)[0])  # ... which G-KV does


def gkv_snapkv_settings() -> list[str]:
    """Every ``{policy: gkv, ...}`` eval setting the README, docs and recipes give with
    redundancy off (``mix_lambda: 1.0``) and no score cache: G-KV's "SnapKV" recipe."""
    root = Path(__file__).resolve().parents[1]
    texts = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "recipes").rglob("*.yaml")]
    found = []
    for path in texts:
        for text in re.findall(r"\{policy: gkv,[^}]*\}", path.read_text()):
            setting = yaml.safe_load(text)
            if setting.get("mix_lambda") == 1.0 and setting.get("score_cache") is False:
                found.append(text)
    return found


def test_gkv_snapkv_setting_is_the_references_snapkv():
    """The documented G-KV "SnapKV" line is the reference's SnapKV recipe (``--enable_pooling``
    without redundancy or score cache: ``max_pool1d(S, 5, padding=2)`` of the unnormalised S,
    as gkv.py's ``score_cache`` says), computed here from the formulas: softmax per query head
    over all keys (the window included, causal), max over the group, window columns dropped,
    mean over the window queries. Without ``kernel_size: 5`` the line keeps other tokens."""
    settings = gkv_snapkv_settings()
    assert settings, "no G-KV SnapKV setting found in README.md, docs/ or recipes/"
    rng = np.random.default_rng(3)
    h, g, n, w, d, scale = 2, 2, 24, 4, 8, 8**-0.5
    keys, queries = rng.standard_normal((h, n, d)), 2 * rng.standard_normal((h * g, w, d))
    causal = np.arange(n)[None, :] <= np.arange(n - w, n)[:, None]  # [w, n]
    want = []
    for kv in range(h):
        probs = [
            [softmax(row) for row in np.where(causal, queries[kv * g + j] @ keys[kv].T * scale, -np.inf)]
            for j in range(g)
        ]
        s = np.max(probs, axis=0)[:, : n - w].mean(0)
        want.append([s[max(0, i - 2) : i + 3].max() for i in range(n - w)])
    want = np.array(want)
    obs = Observation(
        keys=torch.tensor(keys, dtype=torch.float32)[None],
        values=torch.zeros(1, h, n, d),
        queries=torch.tensor(queries, dtype=torch.float32)[None],
        key_pos=torch.arange(n).expand(1, h, n),
        query_pos=torch.arange(n - w, n)[None],
        state=None,
        layer=0,
        scaling=scale,
    )
    budget = 12
    best = -np.sort(-want, axis=1)[:, : budget - w]  # max pooling ties neighbours: compare kept scores
    for text in settings:
        kwargs = {k: v for k, v in yaml.safe_load(text).items() if k != "policy"}
        policy = make_policy("gkv", budget=budget, window=w, **kwargs)
        scores = policy.score(obs)[0][0, :, : n - w].numpy()
        np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-7, err_msg=text)
        keep = policy.select(obs, policy.score(obs)[0]).keep[0]
        kept = [sorted(set(keep[kv].tolist()) - set(range(n - w, n))) for kv in range(h)]
        np.testing.assert_array_equal([-np.sort(-want[kv, kept[kv]]) for kv in range(h)], best, err_msg=text)
    unpooled = GKV(budget=budget, window=w, score_cache=False, mix_lambda=1.0)
    assert not np.allclose(unpooled.score(obs)[0][0, :, : n - w].numpy(), want)  # the line without kernel_size


def test_gkv_without_normalisation():
    """normalise=False (the reference's --disable_norm): F smooths the raw S, R enters raw:
    ``λ·max(α·F_old, S) − (1−λ)·R`` with S and R as G-KV without its score cache has them."""
    lam, alpha = 0.3, 0.8
    obs = make_obs(GKV(budget=12, window=4))
    f_old = obs.state[..., 0]
    raw = dict(budget=12, window=4, score_cache=False)
    s = GKV(**raw, mix_lambda=1.0).score(obs)[0]  # S, unnormalised
    r = -GKV(**raw, mix_lambda=0.0).score(obs)[0]  # R, unnormalised
    f = torch.maximum(alpha * torch.where(f_old.isnan(), s, f_old), s)
    policy = GKV(budget=12, window=4, mix_lambda=lam, alpha=alpha, normalise=False)
    scores, state = policy.score(obs)
    candidates = (obs.key_pos >= 0) & ~policy.always_kept(obs.key_pos)
    torch.testing.assert_close(scores[candidates], (lam * f - (1 - lam) * r)[candidates])
    torch.testing.assert_close(state[..., 0][candidates], f[candidates])
    normalised = GKV(budget=12, window=4, mix_lambda=lam, alpha=alpha).score(obs)[0]
    assert not torch.allclose(normalised[candidates], scores[candidates])


def test_h2o_accumulates_across_two_evictions():
    rng = np.random.default_rng(1)
    g, d, prompt, interval = 2, 4, 10, 4
    policy = H2O(budget=6, window=2, interval=interval)
    keys, queries = rng.standard_normal((prompt + interval, d)), rng.standard_normal((g, prompt + interval, d))

    def observation(pos, state, q_from):
        qpos = np.arange(q_from, q_from + interval)
        return Observation(
            keys=torch.tensor(keys[pos], dtype=torch.float32).view(1, 1, -1, d),
            values=torch.zeros(1, 1, len(pos), d),
            queries=torch.tensor(queries[:, qpos], dtype=torch.float32).view(1, g, interval, d),
            key_pos=torch.tensor(pos).view(1, 1, -1),
            query_pos=torch.tensor(qpos).view(1, -1),
            state=state,
            layer=0,
            scaling=d**-0.5,
        )

    # eviction 1 right after prefill (generated = 0): the last `interval` prompt queries
    assert should_evict(0, prompt, policy, prompt)
    pos1 = list(range(prompt))
    obs1 = observation(pos1, None, prompt - interval)
    scores1, state1 = policy.score(obs1)
    keep = policy.select(obs1, scores1).keep[0, 0].tolist()
    kept = [pos1[i] for i in keep]
    # decode `interval` tokens, then eviction 2 sees the compacted cache + the new tokens
    assert not should_evict(interval - 1, len(kept) + interval - 1, policy, prompt + interval - 1)
    assert should_evict(interval, len(kept) + interval, policy, prompt + interval)
    pos2 = kept + list(range(prompt, prompt + interval))
    state2 = torch.cat([state1[:, :, keep], torch.full((1, 1, interval, 1), float("nan"))], 2)
    scores2, _ = policy.score(observation(pos2, state2, prompt))

    # brute force: every observed query's attention over the cache it saw when decoded
    acc = {p: 0.0 for p in range(prompt + interval)}
    for qp in range(prompt - interval, prompt + interval):
        cache = pos1 if qp < prompt else pos2
        seen = [p for p in cache if p <= qp]
        probs = np.mean([softmax(keys[seen] @ queries[h, qp] * d**-0.5) for h in range(g)], axis=0)
        for p, a in zip(seen, probs):
            acc[p] += a
    np.testing.assert_allclose(scores2[0, 0].numpy(), [acc[p] for p in pos2], rtol=1e-5)


@pytest.mark.parametrize(
    "feature,block",
    [("max", 0), ("min", 1), ("sum", 2), ("last16", 3), ("last8", 4), ("last32", 5), ("cumsum", 6), ("decayed", 7)],
)
def test_learned_scorer_features(feature, block):
    """ForesightKV's feature layout [k ‖ v ‖ 8 blocks of G]: wire one feature of query head
    g = 1 straight through the MLP (eviction = GELU(feature)) and compare with NumPy."""
    rng = np.random.default_rng(2)
    g, d, n, w = 2, 4, 40, 36  # 36 observed queries: the last-8/16/32 sums differ from the sum
    policy = LearnedScorer(budget=12, window=4, interval=w, group=g, head_dim=d, layers=1, kv_heads=1)
    with torch.no_grad():
        for p in policy.scorer.parameters():
            p.zero_()
        policy.scorer.w1[0, 0, 2 * d + block * g + 1, 0] = 1.0
        policy.scorer.w2[0, 0, 0] = 1.0
    keys, queries = rng.standard_normal((n, d)), rng.standard_normal((g, w, d))
    state = rng.random((n, 2 * g))
    state[-5:] = np.nan  # new tokens: no accumulated attention yet
    qpos = np.arange(n - w, n)
    attn = np.zeros((w, n))  # query head 1, causal softmax over the whole cache
    for i, qp in enumerate(qpos):
        attn[i, : qp + 1] = softmax(keys[: qp + 1] @ queries[1, i] * 0.5)
    old = np.nan_to_num(state)
    want = {
        "max": attn.max(0),
        "min": attn.min(0),
        "sum": attn.sum(0),
        "last16": attn[-16:].sum(0),
        "last8": attn[-8:].sum(0),
        "last32": attn[-32:].sum(0),
        "cumsum": old[:, 1] + attn.sum(0),
        "decayed": 0.9 * old[:, g + 1] + attn.sum(0),
    }[feature]
    obs = Observation(
        keys=torch.tensor(keys, dtype=torch.float32).view(1, 1, n, d),
        values=torch.zeros(1, 1, n, d),
        queries=torch.tensor(queries, dtype=torch.float32).view(1, g, w, d),
        key_pos=torch.arange(n).view(1, 1, n),
        query_pos=torch.tensor(qpos).view(1, w),
        state=torch.tensor(state, dtype=torch.float32).view(1, 1, n, 2 * g),
        layer=0,
        scaling=0.5,
    )
    scores, new_state = policy.score(obs)
    gelu = 0.5 * want * (1 + np.vectorize(math.erf)(want / math.sqrt(2)))
    np.testing.assert_allclose(-scores[0, 0].detach().numpy(), gelu, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(new_state[0, 0, :, 1].numpy(), old[:, 1] + attn.sum(0), rtol=1e-5)
    np.testing.assert_allclose(new_state[0, 0, :, g + 1].numpy(), 0.9 * old[:, g + 1] + attn.sum(0), rtol=1e-5)


def test_streaming_keeps_sink_and_recent():
    policy = StreamingLLM(budget=8, sink=4, window=2)
    key_pos = torch.tensor([-1, -1] + list(range(18))).view(1, 1, 20)
    obs = Observation(
        keys=torch.randn(1, 1, 20, 4),
        values=torch.randn(1, 1, 20, 4),
        queries=torch.randn(1, 1, 2, 4),
        key_pos=key_pos,
        query_pos=torch.tensor([[16, 17]]),
        state=None,
        layer=0,
        scaling=0.5,
    )
    keep = policy.select(obs, policy.score(obs)[0]).keep
    assert key_pos[0, 0, keep[0, 0]].tolist() == [0, 1, 2, 3, 14, 15, 16, 17]
