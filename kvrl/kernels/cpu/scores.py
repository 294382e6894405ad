"""The policies' scores on the C++ CPU ops (``scores.cpp``, built by :mod:`.native`).

Each function has the signature of its torch specification in
:mod:`kvrl.kernels.reference.scores` and is tested against it; :mod:`kvrl.kernels.dispatch`
runs these on CPU tensors outside autograd once the library has built. Each op works one
(sample, KV head) at a time, so that head's logits or keys stay in the core's cache across
what torch does in a pass each over the whole batch.

* :func:`attention_received` and :func:`pool_slots` replace the torch ops whole;
* :func:`key_redundancy` and :func:`key_redundancy_update` are the torch algorithms run with
  :data:`PASSES`, the C++ versions of their per-head passes, and a scan that resolves a
  column whose exempt row was evicted without comparing it with every row.
"""

from __future__ import annotations

import torch

from kvrl.kernels.cpu import native
from kvrl.kernels.reference import scores as reference


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
    """:func:`~kvrl.kernels.reference.scores.attention_received` as one pass over each head's
    logits; torch's masked fill, softmax, pool and sum are a pass each over the
    [B, H, G, W, N] logits, most of an H2O or SnapKV eviction after the matmul."""
    logits = reference.group_logits(queries, keys, scaling, gqa, order)
    groups = queries.shape[1] // keys.shape[1]
    return native.ops().attention_received(
        logits,
        key_pos.contiguous(),
        query_pos.contiguous(),
        groups,
        gqa == "mean",
        order == "pool_then_softmax",
        candidates_only,
    )


def pool_slots(x: torch.Tensor, valid: torch.Tensor, kernel_size: int, mode: str) -> torch.Tensor:
    """:func:`~kvrl.kernels.reference.scores.pool_slots` in one pass per head (float32 ``x``)."""
    if mode not in reference.POOL_MODES:
        raise ValueError(f"mode={mode!r} is not one of {reference.POOL_MODES}")
    return native.ops().pool_valid(x.contiguous(), valid.contiguous(), kernel_size, mode == "max")


def _unit_keys(kt, valid, eps):
    return native.ops().unit_keys(kt.contiguous(), valid.contiguous(), eps)


def _redundancy(k, norm, valid, pick, eps):
    return native.ops().redundancy(k, norm, valid.contiguous(), pick.contiguous(), eps)


def _previous_picks(pos, prev):  # a position -> slot table per head
    return native.ops().previous_picks(pos.contiguous(), prev.contiguous())


def _block_extremes(blk, cols, new_code, code, valid, threshold, last, newest):  # the passes in one, row by row
    return native.ops().block_extremes(
        blk, cols.contiguous(), new_code.contiguous(), valid.contiguous(), threshold, last, newest
    )


def _stale_picks(k, pos, prev, stale, new, threshold, last):
    return native.ops().stale_picks(k, pos.contiguous(), prev.contiguous(), stale, new, threshold, last)


PASSES = reference.Passes(
    unit_keys=_unit_keys,
    redundancy=_redundancy,
    previous_picks=_previous_picks,
    block_extremes=_block_extremes,
    stale_picks=_stale_picks,
)


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor, *args, **options) -> torch.Tensor:
    """:func:`~kvrl.kernels.reference.scores.key_redundancy` with the C++ passes."""
    return reference.key_redundancy(keys, valid, *args, passes=PASSES, **options)


def key_redundancy_update(
    keys: torch.Tensor, key_pos: torch.Tensor, previous_pick: torch.Tensor, *args, **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~kvrl.kernels.reference.scores.key_redundancy_update` with the C++ passes."""
    return reference.key_redundancy_update(keys, key_pos, previous_pick, *args, passes=PASSES, **options)
