"""Scoring ops shared by the KV policies, in torch: the specification.

Every other implementation of these ops has the signature of the one here and is tested
against it. The C++ CPU accelerator (:mod:`kvrl.kernels.cpu.scores`) replaces
:func:`attention_received` and :func:`pool_slots` whole, and the key redundancy's per-head
passes (:class:`Passes`: finding the previous picks, normalising the keys, the row sums, the
thresholded cosine blocks) inside the algorithms here; :mod:`kvrl.kernels.dispatch` chooses
once per call. Everything is computed in float32, like the references' fp32 softmax,
whatever the dtype of the inputs.

Shapes: B batch, H KV heads, Hq = H·G query heads, W observation queries, N cache slots,
D head dim. Query heads ``h·G … h·G+G−1`` belong to KV head ``h`` (consecutive grouping,
as in transformers' ``repeat_kv`` and vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

_GQA = ("max", "mean")
_ORDERS = ("softmax_then_pool", "pool_then_softmax")


def window_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    scaling: float,
    *,
    gqa: str = "max",
    order: str = "softmax_then_pool",
    candidates_only: bool = False,
) -> torch.Tensor:
    """Attention probabilities of the observation queries over the cache, pooled per KV head.

    Parameters
    ----------
    queries : Tensor [B, Hq, W, D]
        Post-RoPE observation queries (the last W tokens).
    keys : Tensor [B, H, N, D]
        Post-RoPE cached keys.
    key_pos : Tensor [B, H, N] int
        True position of each slot's key, −1 for an invalid (padding/empty) slot.
    query_pos : Tensor [B, W] int
        True position of each query, −1 for a padding query.
    scaling : float
        Logit scale, normally 1/√D.
    gqa : {"max", "mean"}
        How the G query heads of a group are pooled into their KV head.
    order : {"softmax_then_pool", "pool_then_softmax"}
        ``"softmax_then_pool"``: softmax per query head, then pool the probabilities over the
        group (G-KV, SnapKV, H2O). ``"pool_then_softmax"``: pool the logits over the group,
        then one softmax (R-KV's ``compute_attention_scores``).
    candidates_only : bool
        Leave the keys of the observation queries themselves (key position ≥ the row's
        first valid query position, i.e. the last W positions) out of the softmax
        denominator: R-KV's ``softmax(attn[..., -w:, :-w])``. Their columns are then 0.

    Returns
    -------
    Tensor [B, H, W, N] float32
        Probabilities; causal by true positions (query q sees key k iff 0 ≤ k ≤ q); invalid
        slots, and rows of queries that see no key at all, are 0.
    """
    b, hq, w, _ = queries.shape
    h, n = keys.shape[1], keys.shape[2]
    logits = group_logits(queries, keys, scaling, gqa, order).view(b, h, hq // h, w, n)
    # A finite fill instead of -inf: a row with nothing visible becomes uniform instead of
    # NaN and is zeroed below, so no NaN can reach a gradient through torch.where. The fill
    # comes after pooling the logits (a mean of fills would overflow to -inf). Masks apply
    # from column lo, the first one that some query cannot see: at an eviction that is the
    # window's own keys, so the masks, the fill and the final product skip the rest of the
    # cache. Some query of row b cannot see key k iff k < 0 or k > the row's smallest query
    # position (−1 for a padding query, which sees nothing), or k is a non-candidate.
    qmin = query_pos.amin(-1)[:, None, None]  # [B, 1, 1]
    blind = (key_pos < 0) | (key_pos > qmin)  # [B, H, N]: some query of the row cannot see the slot
    if candidates_only:
        first = torch.where(query_pos >= 0, query_pos, torch.iinfo(query_pos.dtype).max).amin(-1)[:, None, None]
        blind |= key_pos >= first
    cols = blind.flatten(0, -2).any(0)  # [N]
    lo = int(torch.where(cols.any(), cols.int().argmax(), n))
    kp = key_pos[:, :, None, lo:]
    qp = query_pos[:, None, :, None]
    visible = (kp >= 0) & (kp <= qp) & (qp >= 0)  # [B, H, W, N − lo]; every query sees the columns before lo
    if candidates_only:
        visible &= kp < first[..., None]
    hidden = ~visible
    low = torch.finfo(torch.float32).min
    pool = (lambda x: x.amax(2)) if gqa == "max" else (lambda x: x.mean(2))
    # Under autograd the pooled logits and the probabilities are masked out of place:
    # amax's and softmax's backward read their outputs.
    tracked = logits.requires_grad
    if order == "softmax_then_pool":
        logits[..., lo:].masked_fill_(hidden[:, :, None], low)
        probs = pool(logits.softmax(-1))
    else:
        probs = pool(logits)
        if tracked:
            probs = torch.cat([probs[..., :lo], probs[..., lo:].masked_fill(hidden, low)], -1)
        else:
            probs[..., lo:].masked_fill_(hidden, low)
        probs = probs.softmax(-1)
    if tracked:
        return torch.cat([probs[..., :lo], probs[..., lo:] * visible], -1)
    probs[..., lo:].mul_(visible)
    return probs


def attention_received(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    scaling: float,
    *,
    gqa: str = "max",
    order: str = "softmax_then_pool",
    candidates_only: bool = False,
) -> torch.Tensor:
    """The attention each slot received from the observation queries, summed over them:
    ``window_attention(...).sum(2)``, [B, H, N] float32 (same parameters).

    H2O, SnapKV, R-KV and G-KV all need only this sum (the CPU accelerator computes it
    without the [B, H, W, N] probabilities: :func:`kvrl.kernels.cpu.scores.attention_received`).
    """
    return window_attention(
        queries, keys, key_pos, query_pos, scaling, gqa=gqa, order=order, candidates_only=candidates_only
    ).sum(2)


def group_logits(queries: torch.Tensor, keys: torch.Tensor, scaling: float, gqa: str, order: str) -> torch.Tensor:
    """Scaled float32 logits [B, H, G·W, N] of each KV head's query group over its keys."""
    if gqa not in _GQA:
        raise ValueError(f"gqa={gqa!r} is not one of {_GQA}")
    if order not in _ORDERS:
        raise ValueError(f"order={order!r} is not one of {_ORDERS}")
    b, hq, w, d = queries.shape
    h = keys.shape[1]
    if hq % h:
        raise ValueError(f"queries have {hq} heads, not a multiple of the {h} KV heads of keys")
    # Scaled queries (W·D values, not W·N logits): at a vLLM eviction of many requests each
    # pass over the logits is the cost.
    q = (queries.float() * scaling).reshape(b, h, hq // h * w, d)
    return q @ keys.float().transpose(-1, -2)


# R-KV's retain_direction values: "last" (both versions of R-KV, and G-KV), "first" (the paper's
# code, rkv/utils.py), "first_vllm" (R-KV's later vLLM port, vLLM/rkv/algo.py).
RETAIN_DIRECTIONS = ("last", "first", "first_vllm")
# Which valid slot takes the zeroed entry of a token without any near-duplicate, under
# ``fallback=True``: R-KV's max/min over indices that are 0 (rkv/utils.py) or clamped to N − 1
# (the vLLM port) where there is no near-duplicate. The paper's "first" always falls back.
_FALLBACK = {"last": "first", "first": "first", "first_vllm": "last"}
# Elements of one [B, H, tile, tile] cosine block: 16 MiB of float32 on a CPU (cache-sized);
# 256 MiB elsewhere, where fewer, larger blocks save kernel launches (one block for a
# vLLM request with 8 KV heads up to N ≈ 2900).
_BLOCK_ELEMENTS = {"cpu": 1 << 22, "other": 1 << 26}
_MAX_TILE = 4094  # keeps the blocks' index codes (< (tile + 1)² ≤ 2²⁴) exact in float32


class Passes(NamedTuple):
    """The per-head passes of :func:`key_redundancy` and :func:`key_redundancy_update`.

    :data:`TORCH` holds the torch passes below, the specification;
    :data:`kvrl.kernels.cpu.scores.PASSES` runs them in C++, one head at a time in the core's
    cache. A call runs one set throughout (``passes=``, chosen by :mod:`kvrl.kernels.dispatch`).
    ``stale_picks`` has no torch pass: without it an evicted pick's column is compared with
    every row (see :func:`key_redundancy_update`).
    """

    unit_keys: Callable  # (kt [B, H, D, N], valid, eps) -> (k, norm): :func:`_unit_keys`
    redundancy: Callable  # (k, norm, valid, pick, eps) -> [B, H, N]: :func:`_row_sums_softmax`
    previous_picks: Callable  # (pos, prev) -> (kept, need, new): :func:`_previous_picks`
    block_extremes: Callable  # (blk, cols, new_code, code, valid, threshold, last, newest) -> extreme
    stale_picks: Callable | None  # (k, pos, prev, stale, new, threshold, last) -> kept slots of the stale columns


def key_redundancy(
    keys: torch.Tensor,
    valid: torch.Tensor,
    threshold: float = 0.5,
    *,
    retain_direction: str = "last",
    fallback: bool = False,
    eps: float = 1e-6,
    tile: int | None = None,
    passes: Passes | None = None,
) -> torch.Tensor:
    """Per-sample key redundancy: R-KV's ``cal_similarity``, G-KV's ``cal_similarity_triton``.

    1. cosine similarity of the keys (norm + ``eps``); the diagonal, invalid rows and columns 0;
    2. for every column n, the entry of one near-duplicate row m (``cos(m, n) > threshold``)
       is zeroed: ``"last"``, the **latest** such row (copies at slots 10 < 30 < 45 are
       penalised by 30 and 45, by 10, and by neither: the newest copy survives);
       ``"first_vllm"``, the **earliest** (the oldest survives); ``"first"`` (R-KV's paper
       code), the first valid row, whatever the cosines;
    3. row sums ÷ number of valid tokens; invalid slots −inf; softmax over the N slots.

    ``fallback``: a token with no near-duplicate has its cosine with the first (``"last"``)
    or last (``"first_vllm"``) valid slot zeroed instead, as the references do (``"first"``
    does so for every token). Each sample uses its own keys; slots must be in position order
    among the valid ones. The cosines are computed once per unordered pair, a [B, H, tile,
    tile] block at a time; :func:`key_redundancy_update` gives the same from fewer pairs at an
    eviction. Sources, the fallback's size, G-KV's kernels: ``docs/fidelity.md#key-redundancy``.

    Parameters
    ----------
    keys : Tensor [B, H, N, D]
    valid : Tensor [B, H, N] bool
    threshold : float
        Near-duplicate cosine threshold (0.5, hard-coded in both references).
    retain_direction : {"last", "first", "first_vllm"}
        R-KV's ``retain_direction``: step 2.
    fallback : bool
        The references' rule for a token with no near-duplicate (above).
    eps : float
        Added to the key norms (G-KV: 1e-6; R-KV: 1e-8).
    tile : int, optional
        Side of the square cosine blocks (at most 4094); default: about 2²² elements per
        [B, H, tile, tile] block on a CPU, 2²⁶ elsewhere.
    passes : Passes, optional
        The per-head passes (default :data:`TORCH`).

    Returns
    -------
    Tensor [B, H, N] float32
        Redundancy, a distribution over the valid slots (0 at invalid slots).
    """
    if retain_direction not in RETAIN_DIRECTIONS:
        raise ValueError(f"retain_direction={retain_direction!r} is not one of {RETAIN_DIRECTIONS}")
    passes = TORCH if passes is None else passes
    k, norm = passes.unit_keys(keys.transpose(-1, -2).float(), valid, eps)
    if retain_direction == "first":
        pick = torch.full(valid.shape, -1, dtype=torch.long, device=k.device)
    else:
        pick = _exempt_rows(k, valid, threshold, retain_direction == "last", tile)
    side = _FALLBACK[retain_direction] if fallback or retain_direction == "first" else None
    return _redundancy(passes, k, norm, valid, pick, eps, side)


def key_redundancy_update(
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    previous_pick: torch.Tensor,
    threshold: float = 0.5,
    *,
    retain_direction: str = "last",
    fallback: bool = False,
    eps: float = 1e-6,
    tile: int | None = None,
    passes: Passes | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`key_redundancy` at an eviction, reusing each slot's exempt row ("pick") from
    the previous eviction instead of comparing all N×N key pairs again.

    Between two evictions a cache only loses slots and gains new tokens, later than every old
    one, so a column's pick is known without its N cosines unless it is new (``previous_pick``
    NaN) or its pick was evicted; those columns are compared with every row. An old column
    otherwise takes, under ``"last"``, its latest *new* near-duplicate row if any, else keeps
    its pick; under ``"first_vllm"`` it keeps its pick, and one without (−1) takes its earliest
    new near-duplicate; ``"first"`` compares no pairs. The comparisons are one [U, N] block for
    U new tokens; when half of some head's slots need comparing (the first eviction), the full
    pass of :func:`key_redundancy` runs instead (the C++ passes' scan for an evicted pick:
    ``docs/fidelity.md#key_redundancy_update``).

    Up to a cosine within float32 rounding of ``threshold``, the redundancy and picks are
    ``key_redundancy(keys, key_pos >= 0, ...)``'s, given that ``previous_pick`` holds the
    previous call's picks for the tokens that survived it and NaN for newer ones (R-KV's and
    G-KV's per-token state, compacted with the cache). ``fallback`` is applied afresh at every
    call, since the first and last valid slots change with the cache.

    Parameters
    ----------
    keys : Tensor [B, H, N, D]
    key_pos : Tensor [B, H, N] int
        True positions, −1 for invalid slots; ascending among the valid slots of a head.
    previous_pick : Tensor [B, H, N] float32
        Per slot, the true position of its exempt row as returned by the previous call, −1
        for none, NaN for a token without one (arrived since; all NaN: no state at all).
        Positions, not slots, because compaction moves the slots.
    threshold, retain_direction, fallback, eps, tile, passes
        As in :func:`key_redundancy` (``tile`` only sizes the full pass).

    Returns
    -------
    redundancy : Tensor [B, H, N] float32
        As :func:`key_redundancy`.
    pick : Tensor [B, H, N] float32
        Every valid slot's exempt row now, as a true position (−1: none, and always with
        ``"first"``; exact in float32 below 2²⁴); NaN at invalid slots. The next call's
        ``previous_pick`` after compaction.
    """
    if retain_direction not in RETAIN_DIRECTIONS:
        raise ValueError(f"retain_direction={retain_direction!r} is not one of {RETAIN_DIRECTIONS}")
    passes = TORCH if passes is None else passes
    last = retain_direction == "last"
    side = _FALLBACK[retain_direction] if fallback or retain_direction == "first" else None
    b, h, n, _ = keys.shape
    pos = key_pos.long()
    valid = pos >= 0
    prev = previous_pick.float()
    k, norm = passes.unit_keys(keys.transpose(-1, -2).float(), valid, eps)
    if retain_direction == "first":
        none = torch.full((b, h, n), -1, dtype=torch.long, device=k.device)
        return _redundancy(passes, k, norm, valid, none, eps, side), none.float().masked_fill_(~valid, float("nan"))
    kept, need, new = passes.previous_picks(pos, prev)
    counts = need.sum(-1).amax(-1)  # [B]: the most columns one head of a sample must compare
    full = 2 * counts >= n
    if passes.stale_picks is not None and not bool(full.all()):
        # An evicted pick's column needs a scan of the old rows on its near side, which stops
        # at the first near-duplicate (a few rows of 8 in the vLLM benchmark's caches), not a
        # column of the block: the block then holds the new tokens only, as many per head.
        stale = need & ~new
        kept = torch.where(stale, passes.stale_picks(k, pos, prev, stale, new, threshold, last), kept)
        need = new
    # A batch mixes samples at their first eviction (every column new) with later ones:
    # each part takes its own path, so one newcomer does not make all of them compare N².
    # A path that takes every sample (the common case) indexes with a slice: views, no copies.
    pick = torch.empty(b, h, n, dtype=torch.long, device=k.device)
    n_full = int(full.sum())
    if n_full:
        rows = full if n_full < b else slice(None)
        pick[rows] = _exempt_rows(k[rows], valid[rows], threshold, last, tile)
    if n_full < b:
        rows = ~full if n_full else slice(None)
        pick[rows] = _updated_picks(
            passes,
            k[rows],
            valid[rows],
            threshold,
            last,
            kept[rows],
            need[rows],
            new[rows],
            int(need[rows].sum(-1).amax()),
        )
    pick_pos = torch.where(pick >= 0, pos.gather(-1, pick.clamp(min=0)), -1).float()
    return _redundancy(passes, k, norm, valid, pick, eps, side), pick_pos.masked_fill_(~valid, float("nan"))


def _unit_keys(kt: torch.Tensor, valid: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised float32 keys laid out [B, H, D, N] (invalid slots 0: cos 0 with
    everything) and the norms + eps [B, H, N], from the float32 keys ``kt`` [B, H, D, N].
    Slots along the last dim, because the vLLM engine's keys are a transposed view of
    exactly that ([D, bs] per cache block): the normalisation is then one pass and no
    transposing copy (it took 1 of R-KV's 8 ms per 14-request score call), and the matmuls
    take the transposed operand as it is. Masked only when a slot is invalid (a full vLLM
    eviction has none)."""
    norm = (kt * kt).sum(-2).sqrt_() + eps  # linalg.vector_norm over dim −2 is 15x slower on a CPU
    k = kt / norm[..., None, :]
    if not bool(valid.all()):
        k.masked_fill_(~valid[..., None, :], 0.0)
    return k, norm


def _columns(k: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Columns ``idx`` [B, H, C] of k [B, H, D, N] → [B, H, D, C]."""
    return k.gather(-1, idx[:, :, None, :].expand(-1, -1, k.shape[2], -1))


def _previous_picks(pos: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each previous pick is now: ``kept`` [B, H, N] its slot if it is still in the
    cache, else −1; ``need`` the valid slots that must be compared with every row (new
    tokens and evicted picks); ``new`` the valid slots without a previous pick (NaN).

    Carrying the last valid position over the invalid slots (−1) leaves a sorted row to
    search. A value that is no cache position (an evicted token, or anything else) is
    "not present"."""
    n = pos.shape[-1]
    valid = pos >= 0
    at = torch.searchsorted(pos.cummax(-1).values.float(), prev.nan_to_num(-1.0)).clamp_(max=n - 1)
    present = (prev >= 0) & (pos.gather(-1, at) == prev)
    return torch.where(present, at, -1), valid & ~(present | (prev == -1)), valid & prev.isnan()


def _redundancy(
    passes: Passes,
    k: torch.Tensor,
    norm: torch.Tensor,
    valid: torch.Tensor,
    pick: torch.Tensor,
    eps: float,
    fallback: str | None,
) -> torch.Tensor:
    """Row sums of the cosines without the zeroed entries (pick[n], n), ÷ valid count,
    softmax (``passes.redundancy``); k [B, H, D, N] from ``passes.unit_keys``.
    ``fallback`` ("first" or "last"): a valid column without a pick takes the first or last
    valid slot of its head instead (itself excepted: the diagonal is already 0)."""
    if fallback is not None:
        n = valid.shape[-1]
        slots = torch.arange(n, device=valid.device)
        first = fallback == "first"
        ends = torch.where(valid, slots, n if first else -1)
        end = (ends.amin(-1) if first else ends.amax(-1))[..., None]
        pick = torch.where((pick < 0) & valid & (slots != end), end, pick)
    return passes.redundancy(k, norm, valid, pick, eps)


def _row_sums_softmax(
    k: torch.Tensor, norm: torch.Tensor, valid: torch.Tensor, pick: torch.Tensor, eps: float
) -> torch.Tensor:
    """The torch pass of :func:`_redundancy`: row sums without the entries (pick[n], n)
    (−1: none), ÷ valid count, softmax over the valid slots."""
    b, h, d, n = k.shape
    # Σ_{n≠m} cos(m, n) = k̂_m·Σ_n k̂_n − k̂_m·k̂_m, without the N×N matrix; as a product and
    # a sum, since a batched matrix-vector product is slow on a CPU.
    rowsum = (k * k.sum(-1, keepdim=True)).sum(-2) - (1 - eps / norm).square() * valid
    # Zero entry (pick[n], n): subtract cos(pick[n], n) from row pick[n].
    found = pick >= 0
    row = pick.clamp(min=0)
    step = max(1, _block_elements(k) // 4 // max(1, b * h * d))
    for j0 in range(0, n, step):  # gather the picked rows' keys a chunk of columns at a time
        j1 = min(j0 + step, n)
        cos = (_columns(k, row[..., j0:j1]) * k[..., j0:j1]).sum(-2) * found[..., j0:j1]
        rowsum.scatter_add_(-1, row[..., j0:j1], -cos)
    score = rowsum / valid.sum(-1, keepdim=True).clamp(min=1)
    # A head without any valid slot would be all -inf (NaN after softmax); make it 0.
    return score.masked_fill(~valid, float("-inf")).softmax(-1).nan_to_num(0.0)


def _block_elements(x: torch.Tensor) -> int:
    return _BLOCK_ELEMENTS["cpu" if x.device.type == "cpu" else "other"]


def _exempt_rows(k: torch.Tensor, valid: torch.Tensor, threshold: float, last: bool, tile: int | None) -> torch.Tensor:
    """For every column n of the normalised keys k [B, H, D, N] (invalid slots zero): the
    latest (``last``) or earliest valid row m ≠ n with ``cos(m, n) > threshold``; −1 if none.

    Tiles (I, J) on and below the diagonal, block = cos(rows I, columns J): its column-wise
    extreme gives the candidate rows of I for the columns J and, off the diagonal, by
    symmetry its row-wise extreme gives the candidate rows of J for the columns I. A block is
    compared with the threshold and multiplied by an index code
    ``(a_i + 1)(t + 1) + (a_j + 1)`` in place (a = the local index, reversed for "first"),
    so one max along either axis finds the extreme hit's row or column (0 = no hit)."""
    b, h, _, n = k.shape
    t = tile or int((_block_elements(k) // max(1, b * h)) ** 0.5)
    t = max(1, min(t, n, _MAX_TILE))
    local = torch.arange(t, device=k.device)
    if not last:
        local = local.flip(0)
    code = ((local[:, None] + 1) * (t + 1) + local[None, :] + 1).float()  # [t, t], < 2^24
    none = -1 if last else n
    better = torch.maximum if last else torch.minimum

    def decode(v: torch.Tensor, offset: int, rows: bool) -> torch.Tensor:
        a = (v // (t + 1) if rows else v % (t + 1)) - 1
        return torch.where(v > 0, offset + (a if last else t - 1 - a), none)

    out = torch.full((b, h, n), none, dtype=torch.long, device=k.device)
    for i0 in range(0, n, t):
        i1 = min(i0 + t, n)
        for j0 in range(0, i1, t):
            j1 = min(j0 + t, n)
            blk = k[..., i0:i1].transpose(-1, -2) @ k[..., j0:j1]  # [B, H, ti, tj]
            if j0 == i0:
                blk.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))
            blk.gt_(threshold)
            if threshold < 0:  # invalid slots have cos 0, which passes: mask them explicitly
                blk.mul_(valid[:, :, i0:i1, None]).mul_(valid[:, :, None, j0:j1])
            blk.mul_(code[: i1 - i0, : j1 - j0])
            out[..., j0:j1] = better(out[..., j0:j1], decode(blk.amax(-2).long(), i0, True))
            if j0 < i0:
                out[..., i0:i1] = better(out[..., i0:i1], decode(blk.amax(-1).long(), j0, False))
    return out if last else out.masked_fill_(out == n, -1)


def _updated_picks(
    passes: Passes,
    k: torch.Tensor,
    valid: torch.Tensor,
    threshold: float,
    last: bool,
    kept: torch.Tensor,
    need: torch.Tensor,
    new: torch.Tensor,
    c: int,
) -> torch.Tensor:
    """The exempt rows (slots, −1 if none) of :func:`key_redundancy_update`'s incremental path.

    k [B, H, D, N] normalised keys; kept [B, H, N] the slot of each column's previous pick
    if it is still in the cache, else −1; need [B, H, N] the columns compared with every
    row (at most ``c`` per head); new [B, H, N] the slots that arrived since (⊆ need).

    Blocks of cos(need columns, all rows) are thresholded and multiplied by a row code
    (slot + 1 for "last", N − slot for "first"; 0 = no hit), so one max along the rows
    finds each need column's extreme near-duplicate; multiplied instead by the code of the
    new columns only, one max along them finds every column's extreme *new* near-duplicate
    (``passes.block_extremes``)."""
    b, h, _, n = k.shape
    cols = (~need).to(torch.uint8).argsort(dim=-1, stable=True)[..., :c]  # the need columns, ascending
    slots = torch.arange(n, device=k.device)
    code = (slots + 1 if last else n - slots).float()
    new_code = torch.where(new.gather(-1, cols), code[cols], 0.0)  # [B, H, c]
    extreme = k.new_empty(b, h, c)  # per need column, over all rows
    newest = k.new_zeros(b, h, n)  # per column, over the new rows
    step = max(1, _block_elements(k) // max(1, b * h * n))
    for c0 in range(0, c, step):
        c1 = min(c0 + step, c)
        blk = _columns(k, cols[..., c0:c1]).transpose(-1, -2) @ k  # [B, H, c1 − c0, N]
        extreme[..., c0:c1] = passes.block_extremes(
            blk, cols[..., c0:c1], new_code[..., c0:c1], code, valid, threshold, last, newest
        )

    def decode(v: torch.Tensor) -> torch.Tensor:
        v = v.long()
        return torch.where(v > 0, v - 1 if last else n - v, -1)

    fresh = decode(newest)
    # "last": a new near-duplicate is later than any old one; "first": earlier old picks stay.
    pick = torch.where(fresh >= 0, fresh, kept) if last else torch.where(kept >= 0, kept, fresh)
    recomputed = torch.where(need.gather(-1, cols), decode(extreme), pick.gather(-1, cols))
    return pick.scatter_(-1, cols, recomputed).masked_fill_(~valid, -1)


def _block_extremes(
    blk: torch.Tensor,
    cols: torch.Tensor,
    new_code: torch.Tensor,
    code: torch.Tensor,
    valid: torch.Tensor,
    threshold: float,
    last: bool,
    newest: torch.Tensor,
) -> torch.Tensor:
    """One block of :func:`_updated_picks`: blk [B, H, C, N] = cos(columns ``cols`` [B, H, C],
    all rows) → per column the row code ``code`` [N] of its extreme near-duplicate (0: none),
    [B, H, C]; ``newest`` [B, H, N] raised in place, per slot, to the largest ``new_code``
    [B, H, C] of the columns it is a near-duplicate of. ``blk`` is overwritten: both
    products are made in place, since a fresh block-sized temporary costs more than the
    passes (page faults of a new allocation). The torch pass reads the direction from
    ``code``, the C++ one from ``last``."""
    blk.scatter_(-1, cols[..., None], float("-inf"))  # a slot is not its own near-duplicate
    blk.gt_(threshold)
    if threshold < 0:  # invalid rows have cos 0, which passes: mask them explicitly
        blk.mul_(valid[:, :, None, :])
    extreme = blk.mul_(code).amax(-1)
    # every code is ≥ 1, so clamping turns the coded hits back into 1s
    torch.maximum(newest, blk.clamp_(max=1).mul_(new_code[..., None]).amax(-2), out=newest)
    return extreme


TORCH = Passes(
    unit_keys=_unit_keys,
    redundancy=_row_sums_softmax,
    previous_picks=_previous_picks,
    block_extremes=_block_extremes,
    stale_picks=None,
)


POOL_MODES = ("max", "avg")


def pool_slots(x: torch.Tensor, valid: torch.Tensor, kernel_size: int, mode: str) -> torch.Tensor:
    """1-D pooling along the cache, over the valid slots only (SnapKV/R-KV/G-KV smoothing).

    Neighbours are the previous/next *valid* slots, so an invalid slot in the middle of a
    cache does not change the result (batch rows with different padding score alike).
    Stride 1, padding ``kernel_size // 2``: ``"max"`` pads with −inf (``max_pool1d``),
    ``"avg"`` with zeros that count in the mean (``avg_pool1d``'s default, as SnapKV).

    Parameters
    ----------
    x : Tensor [B, H, N]
    valid : Tensor [B, H, N] bool
    kernel_size : int
        Odd.
    mode : {"max", "avg"}

    Returns
    -------
    Tensor [B, H, N]; 0 at invalid slots.
    """
    if mode not in POOL_MODES:
        raise ValueError(f"mode={mode!r} is not one of {POOL_MODES}")
    # Move the valid slots to the front (stable, so in order), pool, and move them back.
    order = (~valid).to(torch.uint8).argsort(dim=-1, stable=True)
    packed = x.gather(-1, order)
    packed_valid = valid.gather(-1, order)
    pad = kernel_size // 2
    if mode == "max":
        packed = F.max_pool1d(packed.masked_fill(~packed_valid, float("-inf")), kernel_size, 1, pad)
    else:
        packed = F.avg_pool1d(packed.masked_fill(~packed_valid, 0.0), kernel_size, 1, pad)
    out = torch.empty_like(packed).scatter_(-1, order, packed)
    return out.masked_fill(~valid, 0.0)


def gather_slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per-head compaction gather: ``out[b, h, j, ...] = x[b, h, idx[b, h, j], ...]``.

    Parameters
    ----------
    x : Tensor [B, H, N, ...]
        Keys, values, positions or per-token state.
    idx : Tensor [B, H, K] int64
        Slot indices to keep (``Selection.keep``).

    Returns
    -------
    Tensor [B, H, K, ...]
    """
    # One row copy per kept slot (index_select over the flattened slots): 3x faster on a
    # CPU than torch.gather with an index expanded over the trailing dims.
    b, h, n = x.shape[:3]
    rows = (torch.arange(b * h, device=idx.device).view(b, h, 1) * n + idx).flatten()
    return x.reshape(b * h * n, *x.shape[3:]).index_select(0, rows).view(*idx.shape, *x.shape[3:])
