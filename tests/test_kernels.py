"""Torch reference kernels against naive per-element loops."""

import math
import zlib

import pytest
import torch

from kvrl.kernels import (
    attention_received,
    gather_slots,
    key_redundancy,
    key_redundancy_update,
    pool_slots,
    window_attention,
)
from kvrl.kernels.cpu import native
from kvrl.kernels.reference import scores as reference


def naive_window_attention(queries, keys, key_pos, query_pos, scaling, gqa, order, candidates_only):
    b_, hq, w_, _ = queries.shape
    h_, n_ = keys.shape[1], keys.shape[2]
    g_ = hq // h_
    out = torch.zeros(b_, h_, w_, n_, dtype=torch.float64)
    pool = max if gqa == "max" else (lambda xs: sum(xs) / len(xs))
    for b in range(b_):
        valid_q = [int(p) for p in query_pos[b] if p >= 0]
        first = min(valid_q) if valid_q else None
        for h in range(h_):
            for w in range(w_):
                qp = int(query_pos[b, w])
                seen = [
                    n
                    for n in range(n_)
                    if 0 <= key_pos[b, h, n] <= qp and qp >= 0 and not (candidates_only and key_pos[b, h, n] >= first)
                ]
                if not seen:
                    continue
                logits = {
                    g: {n: float(queries[b, h * g_ + g, w].double() @ keys[b, h, n].double()) * scaling for n in seen}
                    for g in range(g_)
                }
                if order == "softmax_then_pool":
                    probs = {}
                    for g in range(g_):
                        z = sum(math.exp(v) for v in logits[g].values())
                        probs[g] = {n: math.exp(v) / z for n, v in logits[g].items()}
                    for n in seen:
                        out[b, h, w, n] = pool([probs[g][n] for g in range(g_)])
                else:
                    pooled = {n: pool([logits[g][n] for g in range(g_)]) for n in seen}
                    z = sum(math.exp(v) for v in pooled.values())
                    for n in seen:
                        out[b, h, w, n] = math.exp(pooled[n]) / z
    return out


@pytest.mark.parametrize("gqa", ["max", "mean"])
@pytest.mark.parametrize("order", ["softmax_then_pool", "pool_then_softmax"])
@pytest.mark.parametrize("candidates_only", [False, True])
def test_window_attention_matches_loop(gqa, order, candidates_only):
    torch.manual_seed(0)
    b, h, g, n, w, d = 2, 2, 3, 9, 3, 4
    queries, keys = torch.randn(b, h * g, w, d), torch.randn(b, h, n, d)
    key_pos = torch.arange(n).expand(b, h, n).clone()
    key_pos[1, :, :2] = -1  # left padding
    key_pos[1, 1, 4] = -1  # an empty slot in the middle of one head
    key_pos[0, 0] = torch.tensor([0, 2, 3, 5, 6, 7, 8, 9, 10])  # a compacted head: gaps
    query_pos = torch.tensor([[8, 9, 10], [-1, 7, 8]])  # row 1: a padding query (short prompt)
    key_pos[0, 1] = torch.tensor([0, 1, 4, 5, 6, 7, 8, 9, 10])
    got = window_attention(
        queries, keys, key_pos, query_pos, 0.5, gqa=gqa, order=order, candidates_only=candidates_only
    )
    want = naive_window_attention(queries, keys, key_pos, query_pos, 0.5, gqa, order, candidates_only)
    assert got.shape == (b, h, w, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert (got[1, :, 0] == 0).all()  # the padding query sees nothing


@pytest.mark.parametrize("gqa", ["max", "mean"])
@pytest.mark.parametrize("order", ["softmax_then_pool", "pool_then_softmax"])
def test_window_attention_at_an_eviction(gqa, order):
    """A vLLM eviction's shape (every slot valid, the queries the last W positions): only
    the window's own columns are masked (the fill and the product start there). Equal to the
    loop, and with keys that require grad (out-of-place masks) equal again and differentiable."""
    torch.manual_seed(0)
    b, h, g, n, w, d = 2, 2, 2, 12, 3, 4
    queries, keys = torch.randn(b, h * g, w, d), torch.randn(b, h, n, d)
    key_pos = torch.arange(n).expand(b, h, n)
    query_pos = torch.arange(n - w, n).expand(b, w)
    want = naive_window_attention(queries, keys, key_pos, query_pos, 0.5, gqa, order, False)
    got = window_attention(queries, keys, key_pos, query_pos, 0.5, gqa=gqa, order=order)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert (got[..., 0, n - w + 1 :] == 0).all()  # the first query does not see the later ones
    keys.requires_grad_()
    graded = window_attention(queries, keys, key_pos, query_pos, 0.5, gqa=gqa, order=order)
    torch.testing.assert_close(graded.detach(), got)
    graded[..., : n - w].sum().backward()
    assert keys.grad is not None and keys.grad.isfinite().all() and keys.grad.abs().sum() > 0


@pytest.mark.parametrize("gqa", ["max", "mean"])
@pytest.mark.parametrize("order", ["softmax_then_pool", "pool_then_softmax"])
@pytest.mark.parametrize("candidates_only", [False, True])
@pytest.mark.parametrize("use_native", [True, False])
def test_attention_received_matches_loop(gqa, order, candidates_only, use_native, monkeypatch):
    """The sum over the queries that H2O, SnapKV, R-KV and G-KV score with, on the native CPU
    op (kvrl/kernels/cpu/scores.cpp) and on torch: the loop's sum within float32 rounding.
    21 slots (two 8-lane blocks and a tail), keys in the engine's transposed layout, logits up
    to about ±60 so that the exponentials span the float32 range."""
    if use_native and native.ops() is None:
        pytest.skip("the native CPU ops did not build here")
    monkeypatch.setattr(native, "usable", lambda *t: use_native)
    torch.manual_seed(1)
    b, h, g, n, w, d = 3, 2, 4, 21, 5, 8
    queries = torch.randn(b, h * g, w, d) * 3
    keys = (torch.randn(b, h, d, n) * 3).transpose(-1, -2)
    key_pos = torch.arange(n).expand(b, h, n).clone()
    key_pos[1, :, :3] = -1  # left padding
    key_pos[1, 1, 9] = -1  # an empty slot in the middle of one head
    key_pos[0, 0] = torch.tensor([0, 2, 3, *range(5, 23)])  # a compacted head: gaps
    query_pos = torch.tensor([[18, 19, 20, 21, 22], [-1, 16, 18, 19, 20], [-1, -1, -1, -1, -1]])
    key_pos[0, 1, -1] = 24  # a slot no query sees
    got = attention_received(
        queries, keys, key_pos, query_pos, 0.5, gqa=gqa, order=order, candidates_only=candidates_only
    )
    want = naive_window_attention(queries, keys, key_pos, query_pos, 0.5, gqa, order, candidates_only).sum(2)
    assert got.shape == (b, h, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert (got[2] == 0).all() and (got[1, :, :3] == 0).all() and got[0, 1, -1] == 0


def test_native_attention_received_refuses_positions_beyond_32_bits():
    """The native op compares positions in 32 bits (one vector compare per query): a query
    position it cannot represent is an error, not a wrong mask."""
    if native.ops() is None:
        pytest.skip("the native CPU ops did not build here")
    logits, key_pos = torch.zeros(1, 1, 1, 3), torch.arange(3).view(1, 1, 3)
    with pytest.raises(RuntimeError, match="below 2"):
        native.ops().attention_received(logits, key_pos, torch.tensor([[2**31]]), 1, True, False, False)
    assert native.ops().attention_received(logits, key_pos, torch.tensor([[2]]), 1, True, False, False).sum() == 1


def test_window_attention_rejects_bad_options():
    q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 4)
    pos, qpos = torch.arange(3).view(1, 1, 3), torch.tensor([[2]])
    with pytest.raises(ValueError, match="gqa"):
        window_attention(q, k, pos, qpos, 1.0, gqa="min")
    with pytest.raises(ValueError, match="order"):
        window_attention(q, k, pos, qpos, 1.0, order="pool")


def naive_redundancy(keys, valid, threshold=0.5, eps=1e-6, direction="last"):
    b_, h_, n_, _ = keys.shape
    out = torch.zeros(b_, h_, n_, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            k = keys[b, h].double()
            k = k / (k.norm(dim=-1, keepdim=True) + eps)
            ok = [n for n in range(n_) if valid[b, h, n]]
            cos = {(m, n): float(k[m] @ k[n]) for m in ok for n in ok if m != n}
            for n in ok:  # zero the latest (first_vllm: earliest) row similar to column n
                rows = [m for m in ok if m != n and cos[m, n] > threshold]
                if rows:
                    cos[max(rows) if direction == "last" else min(rows), n] = 0.0
            rowsum = {m: sum(v for (mm, _), v in cos.items() if mm == m) / len(ok) for m in ok}
            z = sum(math.exp(v) for v in rowsum.values())
            for m in ok:
                out[b, h, m] = math.exp(rowsum[m]) / z
    return out


@pytest.mark.parametrize("direction", ["last", "first_vllm"])
def test_key_redundancy_matches_loop(direction):
    torch.manual_seed(1)
    b, h, n, d = 2, 2, 10, 4
    base = torch.randn(b, h, 3, d)
    keys = base[:, :, torch.randint(0, 3, (n,))] + 0.4 * torch.randn(b, h, n, d)  # many near-duplicates
    valid = torch.ones(b, h, n, dtype=torch.bool)
    valid[1, :, :3] = False
    valid[0, 1, 5] = False
    want = naive_redundancy(keys, valid, direction=direction)
    for tile in (None, 1, 3):
        got = key_redundancy(keys, valid, retain_direction=direction, tile=tile)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
        assert (got[~valid] == 0).all()


def dense_redundancy(keys, valid, threshold=0.5, *, eps=1e-6, direction="last", fallback=False):
    """The dense implementation the tiled ``key_redundancy`` replaced, kept as its reference
    (N×N cosines and masks): per column the latest ("last") or earliest ("first_vllm")
    near-duplicate row, or the first valid row ("first", R-KV's paper code); ``fallback``: a
    column without one takes the first ("last") or last ("first_vllm") valid row."""
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + eps)
    cos = k @ k.transpose(-1, -2)  # [B, H, N(rows m), N(columns n)]
    n = cos.shape[-1]
    slots = torch.arange(n, device=keys.device)
    pair = valid[..., :, None] & valid[..., None, :] & (slots[:, None] != slots[None, :])
    cos = cos.masked_fill(~pair, 0.0)
    hit = (cos > threshold) & pair
    if direction == "first_vllm":
        latest = torch.where(hit, slots[:, None], n).amin(-2)
        latest = latest.masked_fill(latest == n, -1)
    else:
        latest = torch.where(hit, slots[:, None], -1).amax(-2)  # per column
    if direction == "first":
        latest = torch.full_like(latest, -1)
    if fallback or direction == "first":
        first_valid = torch.where(valid, slots, n).amin(-1, keepdim=True)
        last_valid = torch.where(valid, slots, -1).amax(-1, keepdim=True)
        end = last_valid if direction == "first_vllm" else first_valid
        latest = torch.where((latest < 0) & valid & (slots != end), end, latest)
    cos = cos.masked_fill(slots[:, None] == latest[..., None, :], 0.0)
    score = cos.sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1)
    return score.masked_fill(~valid, float("-inf")).softmax(-1).nan_to_num(0.0)


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def redundancy_case(name):
    """(keys [B, H, N, D], valid [B, H, N]) for the equivalence tests."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # str hash() varies per process
    b, h, n, d = 2, 3, 70, 16
    valid = torch.ones(b, h, n, dtype=torch.bool)
    if name == "random":
        keys = torch.randn(b, h, n, d, generator=gen) + 0.7 * torch.randn(b, h, 1, d, generator=gen)
    elif name == "clustered":  # many near-duplicates, as in real caches
        centres = torch.randn(b, h, 5, d, generator=gen)
        keys = centres[:, :, torch.randint(0, 5, (n,), generator=gen)] + 0.5 * torch.randn(b, h, n, d, generator=gen)
    elif name == "exact_duplicates":  # copies scattered across tiles, some of them invalid
        keys = torch.randn(b, h, n, d, generator=gen)
        for group in ([1, 3, 5, 40, 69], [0, 2, 33, 34], [10, 11]):
            keys[:, :, group] = 3 * keys[:, :, group[:1]]
        valid[0, 0, [3, 33]] = False
    elif name == "near_threshold":  # cosines 0.5 ± 1e-4, 0.5 ± 1e-3 (far from float rounding)
        axis = unit(torch.randn(b, h, 1, d, generator=gen))
        other = unit(torch.randn(b, h, n, d, generator=gen))
        other = unit(other - (other * axis).sum(-1, keepdim=True) * axis)  # orthogonal to axis
        c = 0.5 + torch.tensor([-1e-3, -1e-4, 1e-4, 1e-3])[torch.randint(0, 4, (n,), generator=gen)]
        keys = 5 * (c[:, None] * axis + (1 - c[:, None] ** 2).sqrt() * other)
        keys[:, :, ::7] = 5 * axis  # copies of the axis: each slot's cos with them is c
    elif name == "holes":  # invalid slots in the middle, NaN garbage in some of them
        centres = torch.randn(b, h, 4, d, generator=gen)
        keys = centres[:, :, torch.randint(0, 4, (n,), generator=gen)] + 0.4 * torch.randn(b, h, n, d, generator=gen)
        valid[:, :, 20:31] = False
        valid[1, 2, ::3] = False
        keys[0, 1, 25] = float("nan")
    elif name == "all_invalid_heads":
        keys = torch.randn(b, h, n, d, generator=gen)
        keys[:, :, 30:] = keys[:, :, :40]
        valid[0, 1] = False
        valid[1, :] = False
    elif name == "ragged":  # left padding of a different length per row and head
        centres = torch.randn(b, h, 6, d, generator=gen)
        keys = centres[:, :, torch.randint(0, 6, (n,), generator=gen)] + 0.6 * torch.randn(b, h, n, d, generator=gen)
        for i, pad in enumerate([0, 3, 17, 45, 69, 1]):
            valid[i // h, i % h, :pad] = False
    elif name == "bf16":
        centres = torch.randn(b, h, 5, d, generator=gen)
        keys = (
            centres[:, :, torch.randint(0, 5, (n,), generator=gen)] + 0.5 * torch.randn(b, h, n, d, generator=gen)
        ).bfloat16()
    return keys, valid


CASES = ["random", "clustered", "exact_duplicates", "near_threshold", "holes", "all_invalid_heads", "ragged", "bf16"]


# retain_direction and fallback: both R-KV versions' rules ("first" always falls back)
RULES = [("last", False), ("last", True), ("first", False), ("first_vllm", False), ("first_vllm", True)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direction,fallback", RULES)
def test_key_redundancy_equals_dense(case, direction, fallback):
    """The tiled kernel against the dense implementation it replaced, within 1e-6."""
    keys, valid = redundancy_case(case)
    for threshold in (0.5, 0.0, 0.8, -0.3):
        want = dense_redundancy(keys, valid, threshold, direction=direction, fallback=fallback)
        for tile in (None, 5, 32):
            got = key_redundancy(keys, valid, threshold, retain_direction=direction, fallback=fallback, tile=tile)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            assert (got - want).abs().max() <= 1e-6
            assert (got[~valid] == 0).all()
    dead = ~valid.any(-1)
    assert (key_redundancy(keys, valid)[dead] == 0).all()


def test_key_redundancy_equals_dense_at_scale():
    """A few hundred slots, default tiles (several per row), both directions."""
    gen = torch.Generator().manual_seed(5)
    centres = torch.randn(2, 2, 32, 64, generator=gen)
    keys = centres[:, :, torch.randint(0, 32, (600,), generator=gen)] + 0.7 * torch.randn(2, 2, 600, 64, generator=gen)
    valid = torch.rand(2, 2, 600, generator=gen) > 0.1
    for direction in ("last", "first_vllm"):
        want = dense_redundancy(keys, valid, direction=direction)
        for tile in (None, 128):
            got = key_redundancy(keys, valid, retain_direction=direction, tile=tile)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_key_redundancy_equals_dense_on_cuda():
    """The device path (larger default blocks) against the dense version on the same device;
    fp32 matmuls (no TF32), so only the block sizes differ."""
    keys, valid = redundancy_case("clustered")
    keys, valid = keys.cuda(), valid.cuda()
    for direction in ("last", "first_vllm"):
        want = dense_redundancy(keys, valid, direction=direction)
        for tile in (None, 16):
            got = key_redundancy(keys, valid, retain_direction=direction, tile=tile)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direction,fallback", RULES)
def test_key_redundancy_update_equals_key_redundancy(case, direction, fallback):
    """One eviction step on the equivalence cases: picks of slots 0..61 (positions = slots),
    every 4th of slots 0..55 evicted, slots 62..69 new (NaN). The update's redundancy equals
    ``key_redundancy`` of the new cache within 1e-6 and its picks are the full pass's."""
    keys, valid = redundancy_case(case)
    rule = dict(retain_direction=direction, fallback=fallback)
    n = keys.shape[2]
    pos = torch.arange(n).expand_as(valid).masked_fill(~valid, -1)
    nan = torch.full(valid.shape, float("nan"))
    kept = torch.tensor([j for j in range(n) if j >= 56 or j % 4 != 1])
    for threshold in (0.5, 0.0, -0.3):
        _, pick = key_redundancy_update(keys[:, :, :62], pos[:, :, :62], nan[:, :, :62], threshold, **rule)
        state = torch.cat([pick, nan[:, :, 62:]], 2)[:, :, kept]
        cache_keys, cache_pos = keys[:, :, kept], pos[:, :, kept]
        got, got_pick = key_redundancy_update(cache_keys, cache_pos, state, threshold, **rule)
        want = key_redundancy(cache_keys, cache_pos >= 0, threshold, **rule)
        assert (got - want).abs().max() <= 1e-6
        _, full_pick = key_redundancy_update(cache_keys, cache_pos, nan[:, :, kept], threshold, **rule)
        assert torch.equal(got_pick.nan_to_num(-2), full_pick.nan_to_num(-2))
        stale = (state >= 0) & ~(state[..., :, None] == cache_pos[..., None, :]).any(-1)
        assert stale.any() or threshold < 0.5 or case == "all_invalid_heads" or direction == "first"  # evicted picks
        # A batch whose sample 0 evicts for the first time (no state) beside sample 1: each
        # takes its own path (full pass / update), with the same results.
        first = state.clone()
        first[0] = float("nan")
        mixed, mixed_pick = key_redundancy_update(cache_keys, cache_pos, first, threshold, **rule)
        assert (mixed - want).abs().max() <= 1e-6
        assert torch.equal(mixed_pick.nan_to_num(-2), full_pick.nan_to_num(-2))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direction,fallback", RULES)
def test_native_redundancy_equals_torch(case, direction, fallback, monkeypatch):
    """The native CPU ops (kvrl/kernels/cpu/scores.cpp) against the torch code they replace,
    on the update's incremental path and the full pass, with keys laid out as the vLLM
    engine reads them (a transposed view of [B, H, D, N]): the same picks, and redundancy
    within float32 rounding of a sum over N slots and D channels taken in another order."""
    if native.ops() is None:
        pytest.skip("the native CPU ops did not build here")
    keys, valid = redundancy_case(case)
    rule = dict(retain_direction=direction, fallback=fallback)
    keys = keys.transpose(-1, -2).contiguous().transpose(-1, -2)
    n = keys.shape[2]
    pos = torch.arange(n).expand_as(valid).masked_fill(~valid, -1)
    nan = torch.full(valid.shape, float("nan"))
    kept = torch.tensor([j for j in range(n) if j >= 56 or j % 4 != 1])
    for threshold in (0.5, 0.0, -0.3):
        runs = []
        for use in (True, False):
            monkeypatch.setattr(native, "usable", lambda *t, use=use: use)
            _, pick = key_redundancy_update(keys[:, :, :62], pos[:, :, :62], nan[:, :, :62], threshold, **rule)
            state = torch.cat([pick, nan[:, :, 62:]], 2)[:, :, kept]
            runs.append((pick, *key_redundancy_update(keys[:, :, kept], pos[:, :, kept], state, threshold, **rule)))
        (first, red, pick), (first_ref, red_ref, pick_ref) = runs
        assert torch.equal(first.nan_to_num(-2), first_ref.nan_to_num(-2))
        assert torch.equal(pick.nan_to_num(-2), pick_ref.nan_to_num(-2))
        torch.testing.assert_close(red, red_ref, rtol=1e-5, atol=1e-7)


def test_key_redundancy_rejects_unknown_direction():
    with pytest.raises(ValueError, match="retain_direction"):
        key_redundancy(torch.zeros(1, 1, 2, 2), torch.ones(1, 1, 2, dtype=torch.bool), retain_direction="middle")


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("kernel", [3, 7])
def test_pool_slots_skips_invalid_slots(mode, use_native, kernel, monkeypatch):
    if use_native and native.ops() is None:
        pytest.skip("the native CPU ops did not build here")
    monkeypatch.setattr(native, "usable", lambda *t: use_native)
    torch.manual_seed(2)
    x = torch.rand(2, 3, 9) - 0.5
    valid = torch.ones(2, 3, 9, dtype=torch.bool)
    valid[0, 0, [0, 1, 5]] = False
    valid[1, 1, 8] = False
    valid[1, 2] = False  # a head without any valid slot
    got = pool_slots(x, valid, kernel, mode)
    pad = kernel // 2
    for b in range(2):
        for h in range(3):
            ok = [n for n in range(9) if valid[b, h, n]]
            for i, n in enumerate(ok):  # neighbours are the adjacent *valid* slots
                near = [float(x[b, h, m]) for m in ok[max(0, i - pad) : i + pad + 1]]
                want = max(near) if mode == "max" else sum(near) / kernel  # zero padding counts
                assert got[b, h, n].item() == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert (got[~valid] == 0).all()


def test_native_previous_picks_equals_torch():
    """The lookup that starts key_redundancy_update (where is each slot's previous pick now,
    which slots must search again, which are new), native vs its torch specification, on
    positions with gaps and invalid slots in the middle and at the end, and picks that are
    present, evicted, beyond the cache, −1, NaN or not an integer."""
    if native.ops() is None:
        pytest.skip("the native CPU ops did not build here")
    pos = torch.tensor([[[0, 3, 4, -1, 9, 12, 13, -1], [2, -1, -1, 5, 6, 7, 8, 20]]])
    prev = torch.tensor([[[-1, 9, 3, 4, 5.0, float("nan"), 12.5, 13], [20, 2, 3, 7, -1, float("nan"), 99, 8]]])
    kept, need, new = native.ops().previous_picks(pos, prev)
    kept_ref, need_ref, new_ref = reference.TORCH.previous_picks(pos, prev)
    assert torch.equal(kept, kept_ref) and torch.equal(need, need_ref) and torch.equal(new, new_ref)
    assert kept.tolist() == [[[-1, 4, 1, 2, -1, -1, -1, 6], [7, 0, -1, 5, -1, -1, -1, 6]]]


def test_dispatch_picks_by_device_autograd_library_and_the_ops_own_condition(monkeypatch):
    """One table per op: the C++ op for CPU tensors outside autograd once the library built and
    the op's own condition holds, the Triton kernel for CUDA tensors, the reference otherwise."""
    from types import SimpleNamespace

    from kvrl.kernels import dispatch

    table = {"cpu": "cpu", "cuda": "cuda", "reference": "reference"}
    cpu, graded = torch.zeros(2), torch.zeros(2, requires_grad=True)
    gpu = SimpleNamespace(device=torch.device("cuda"), is_cuda=True, requires_grad=False)
    built = native.ops() is not None
    assert dispatch.pick(table, cpu) == ("cpu" if built else "reference")
    assert dispatch.pick(table, cpu, graded) == "reference"
    assert dispatch.pick(table, cpu, applies=False) == "reference"
    assert dispatch.pick(table, gpu) == "cuda" and dispatch.pick(table, gpu, applies=False) == "reference"
    assert dispatch.pick({"cpu": "cpu", "reference": "reference"}, gpu) == "reference"
    assert dispatch.pick({"cuda": "cuda", "reference": "reference"}, cpu) == "reference"
    monkeypatch.setattr(native, "ops", lambda: None)  # the library did not build
    assert dispatch.pick(table, cpu) == "reference"
    # pool_slots' C++ op takes float32 only: a float64 input runs the reference
    x, valid = torch.rand(1, 1, 5, dtype=torch.float64), torch.ones(1, 1, 5, dtype=torch.bool)
    monkeypatch.setattr(native, "usable", lambda *t: True)
    monkeypatch.setitem(dispatch.POOL_SLOTS, "reference", lambda *a: "reference ran")
    assert dispatch.pool_slots(x, valid, 3, "max") == "reference ran"


def test_gather_slots():
    x = torch.arange(2 * 3 * 5 * 2).view(2, 3, 5, 2)
    idx = torch.tensor([[[0, 4], [1, 2], [3, 3]], [[4, 0], [2, 2], [1, 0]]])
    got = gather_slots(x, idx)
    assert got.shape == (2, 3, 2, 2)
    for b in range(2):
        for h in range(3):
            for j in range(2):
                assert torch.equal(got[b, h, j], x[b, h, idx[b, h, j]])
    pos = torch.arange(30).view(2, 3, 5)  # no trailing dims: positions
    assert torch.equal(gather_slots(pos, idx), pos.gather(2, idx))


def test_a_stale_build_lock_is_removed_not_waited_on(tmp_path):
    """A process killed while building the native ops leaves torch's lock file; every later kvrl
    process waited on it forever, silently. Now the next build removes it and says so."""
    import os
    import shutil
    import subprocess
    import sys

    if native.ops() is None:
        pytest.skip("the native ops do not build on this machine")
    name = native.extension_name()
    built = native.build_dir(name)
    root = tmp_path / "ext"
    shutil.copytree(built, root / name)  # already built: the child only re-checks, it does not compile
    (root / name / "lock").touch()
    code = "from kvrl.kernels.cpu import native; assert native.ops() is not None"
    res = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "stale build lock" in res.stderr and not (root / name / "lock").exists()
    assert "building the native CPU ops" not in res.stderr  # a library built for these sources is loaded as it is
