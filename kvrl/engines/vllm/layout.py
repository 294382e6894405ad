"""How kvrl reads and writes vLLM's paged KV caches, independent of any policy.

:class:`PagedLayout` is the one thing a backend supplies (``cpu_backend.CPULayout``,
``cuda_backend.FlashLayout``): how one layer's cache tensor stores K and V, with batched
read / write / compact / attention over many requests' block tables at once.
:class:`SideStore` holds, beside each layer's cache and indexed the same way, every slot's
true position and the policy's per-token state. :class:`HeadPool` numbers the (layer, head)
regions of a request's blocks when RLKV's heads share them (the static regime).
:class:`SideStores` keeps every layer's side store for the worker's life. The request
bookkeeping is :mod:`kvrl.engines.vllm.runtime`; the regimes that use these are
:mod:`.evicting`, :mod:`.static` and :mod:`.mixed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


class PagedLayout:
    """How one attention layer's paged cache tensor stores K and V.

    Request r's logical slot j of KV head h lives in block ``blocks[r, j // bs]`` at offset
    ``j % bs``; every method takes the block tables of several requests at once
    (``blocks`` [R, max_blocks]), so one call serves a whole batch. Subclasses implement
    all three methods (:meth:`compact` with whole-block copies or a kernel).
    """

    def read(self, kv_cache: Tensor, blocks: Tensor, n: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
        """K, V [R, H, n, D] of logical slots 0..n−1 of every head of every request (V
        None unless ``values``)."""
        raise NotImplementedError

    def write(
        self, kv_cache: Tensor, blocks: Tensor, rows: Tensor, heads: Tensor, slots: Tensor, keys: Tensor, values: Tensor
    ) -> None:
        """Store keys/values [M, D] at (request ``rows[i]``, head ``heads[i]``, logical slot ``slots[i]``)."""
        raise NotImplementedError

    def compact(self, kv_cache: Tensor, blocks: Tensor, keep: Tensor, counts: Tensor | None) -> None:
        """In place, per request r and head h: slot j ← slot ``keep[r, h, j]`` for j <
        ``counts[r]`` (None: every request keeps all K; keep [R, H, K] ascending there; the
        rest is ignored, and no block past the one holding slot counts[r] − 1 may be
        written: a request whose count is below K owns fewer). Reads nothing the eviction
        read: a policy may have scored without reading V, or any K/V at all."""
        raise NotImplementedError

    def head_attention(self, query: Tensor, kv_cache: Tensor, blocks: Tensor, lens: Tensor, scale: float) -> Tensor:
        """One query per request, each KV head over its own logical slots 0..``lens[r, h]``−1:
        query [R, Hq, D], blocks [R, nb], lens [R, H] int → [R, Hq, D]. Slot order does not
        matter (one query sees all of them). This default reads the caches padded to the
        longest head; a backend whose kernel takes per-sequence lengths overrides it."""
        hq = query.shape[1]
        keys, values = self.read(kv_cache, blocks, int(lens.max()))
        h, n = keys.shape[1], keys.shape[2]
        visible = torch.arange(n, device=query.device) < lens[:, :, None].to(query.device)  # [R, H, N]
        out = F.scaled_dot_product_attention(
            query[:, :, None],
            keys.to(query.dtype),
            values.to(query.dtype),
            attn_mask=visible.repeat_interleave(hq // h, dim=1)[:, :, None],
            scale=scale,
            enable_gqa=True,
        )
        return out[:, :, 0]

    def gather(self, kv_cache: Tensor, blocks: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """K, V [R, H, W, D] of logical slots ``slots`` [R, W] (every head). This default
        reads the whole prefix; a layout with direct addressing overrides it."""
        keys, values = self.read(kv_cache, blocks, int(slots.max()) + 1)
        idx = slots[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
        return keys.gather(2, idx), values.gather(2, idx)

    def regions(self, kv_cache: Tensor, layer_idx: int) -> Tensor:
        """Every layer's cache as one tensor of (layer, block, head) regions, for
        :class:`HeadPool`; a layout that has them (the CPU one: a region is contiguous)
        also implements ``region_read``, ``region_write`` and ``region_attention``."""
        raise NotImplementedError(
            f"{type(self).__name__} has no (block, head) regions to pool RLKV heads in; "
            "set VLLMEngine.pool_heads = False"
        )


class HeadPool:
    """RLKV heads sharing a request's blocks (the static regime, a sink + recent pattern).

    vLLM gives a request blocks; each block holds, in every layer, one region of ``bs``
    slots per KV head, so a request with n blocks owns n·L·H regions. Left to vLLM, every
    head gets a region per ``bs`` tokens and a windowed head, which sees only sink +
    recent keys, leaves most of its regions unused. Pooled, the request's regions are
    numbered q = 0, 1, … (region q = block ``q // (L·H)`` of its table, in layer and head
    ``divmod(q % (L·H), H)``): the first ``rings`` = W·c hold the W windowed heads' rings of
    c = ⌈(sink + recent) / bs⌉ regions each, then the F full heads take turns, full head k's
    j-th region being q = rings + j·F + k — so the request needs
    :func:`~kvrl.engines.vllm.kv_manager.pooled_blocks` blocks at length m, about (1 − s)
    of the full cache's at sparsity s, and the KV manager allocates no more
    (the engine encodes ``sizes`` in the request id). The same numbering on both sides is
    this class; the region ids come from the layout (:meth:`PagedLayout.regions`).
    """

    def __init__(self, windowed: Tensor, sink: int, recent: int, block_size: int):
        layers, heads = windowed.shape
        self.ring_blocks = c = -(-(sink + recent) // block_size)
        w = windowed.reshape(-1).long()
        nw, nf = int(w.sum()), int((1 - w).sum())
        base = torch.where(w.bool(), (w.cumsum(0) - 1) * c, nw * c + (1 - w).cumsum(0) - 1)
        self.base = base.view(layers, heads)  # region number of each head's logical block 0 ...
        self.stride = torch.where(w.bool(), 1, nf).view(layers, heads)  # ... and from one block to the next
        self.windowed = windowed
        self.sink, self.recent, self.block_size = sink, recent, block_size
        self.sizes = (nw * c, nf, layers * heads)  # (rings, full, regions per block)

    def slots(self, p: Tensor) -> Tensor:
        """Slot [R, L, H] of the key at position p [R] in each head: p itself in a full head;
        in a windowed one p below sink + recent, else its ring slot sink + (p − sink) % recent."""
        w = self.sink + self.recent
        ring = torch.where(p >= w, self.sink + (p - self.sink) % self.recent, p)
        return torch.where(self.windowed.to(p.device), ring[:, None, None], p[:, None, None])

    def table(self, blocks: Tensor, nblk: int, blocks_per_layer: int) -> Tensor:
        """Region ids [R, L, H, nblk] of each head's logical blocks 0..nblk−1 for block
        tables ``blocks`` [R, width] (a windowed head's past its ring repeat its last)."""
        layers, heads = self.base.shape
        dev = blocks.device
        j = torch.arange(nblk, device=dev)
        last = torch.where(self.windowed, self.ring_blocks - 1, nblk - 1).to(dev)
        q = self.base.to(dev)[..., None] + torch.minimum(j, last[..., None]) * self.stride.to(dev)[..., None]
        blk = (q // (layers * heads)).clamp(max=blocks.shape[1] - 1)
        layer, head = (q % (layers * heads)).div(heads, rounding_mode="floor"), q % heads
        return (layer * blocks_per_layer + blocks[:, blk].long()) * heads + head


@dataclass
class SideStore:
    """Per-layer tensors indexed like the cache: true position [nb, H, bs] (int32) and the
    policy's per-token state [nb, H, bs, S] (float32, NaN = none yet)."""

    pos: Tensor
    state: Tensor | None

    @classmethod
    def like(cls, kv_cache: Tensor, state_size: int) -> SideStore:
        nb, h, bs = kv_cache.shape[:3]
        pos = torch.full((nb, h, bs), -1, dtype=torch.int32, device=kv_cache.device)
        state = torch.full((nb, h, bs, state_size), float("nan"), device=kv_cache.device) if state_size else None
        return cls(pos, state)

    def read(self, blocks: Tensor, n: int) -> tuple[Tensor, Tensor | None]:
        """pos [R, H, n] int64 and state [R, H, n, S] of logical slots 0..n−1 (blocks [R, nb])."""
        r, (h, bs) = blocks.shape[0], self.pos.shape[1:]
        nblk = -(-n // bs)
        b = blocks[:, :nblk].long()
        pos = self.pos[b].transpose(1, 2).reshape(r, h, nblk * bs)[..., :n].long()
        state = None
        if self.state is not None:
            state = self.state[b].transpose(1, 2).reshape(r, h, nblk * bs, -1)[:, :, :n]
        return pos, state

    def write(
        self, blocks: Tensor, rows: Tensor, heads: Tensor, slots: Tensor, pos: Tensor, state: Tensor | None
    ) -> None:
        bs = self.pos.shape[2]
        blk, off = blocks[rows, slots // bs].long(), slots % bs
        self.pos[blk, heads, off] = pos.to(torch.int32)
        if self.state is not None:
            self.state[blk, heads, off] = float("nan") if state is None else state

    def write_prefix(self, blocks: Tensor, pos: Tensor, state: Tensor | None, counts: Tensor | None) -> None:
        """pos [R, H, K] and state [R, H, K, S] into logical slots 0..counts[r]−1 of request
        r (None: all K), whole blocks at a time (the rest of its last block gets position −1
        / no state). Only the blocks that hold those slots are written: a request whose
        count is below K (ratio mode) may own fewer blocks, and its table's later entries
        are stale."""
        r, h, k = pos.shape
        bs = self.pos.shape[2]
        nblk = -(-k // bs)
        b = blocks[:, :nblk].long()
        pos = F.pad(pos.to(torch.int32), (0, nblk * bs - k), value=-1).view(r, h, nblk, bs).transpose(1, 2)
        if self.state is not None:
            state = (
                torch.full((r, h, k, self.state.shape[-1]), float("nan"), device=pos.device) if state is None else state
            )
            state = F.pad(state.float(), (0, 0, 0, nblk * bs - k), value=float("nan"))
            state = state.view(r, h, nblk, bs, -1).transpose(1, 2)
        if counts is not None:
            counts = counts.to(pos.device)
            beyond = (torch.arange(nblk * bs, device=pos.device) >= counts[:, None]).view(r, nblk, 1, bs)
            mine = torch.arange(nblk, device=pos.device) * bs < counts[:, None]  # [R, nblk] blocks written
            b, pos = b[mine], pos.masked_fill(beyond, -1)[mine]
            if self.state is not None:
                state = state.masked_fill(beyond[..., None], float("nan"))[mine]
        self.pos[b] = pos
        if self.state is not None:
            self.state[b] = state


class SideStores:
    """Every attention layer's :class:`SideStore`, by layer name, kept for the process's life
    (a worker serves many regimes): one is (re)allocated at its layer's next write once the
    cache's shape or the installed regime's ``state_size`` no longer fits it."""

    def __init__(self):
        self.by_layer: dict[str, SideStore] = {}
        self.state_size = 0

    def resize(self, state_size: int) -> None:
        """A regime with ``state_size`` floats of policy state per slot is installed."""
        self.state_size = state_size
        for name, side in list(self.by_layer.items()):
            if (side.state.shape[-1] if side.state is not None else 0) != state_size:
                del self.by_layer[name]  # reallocated at the next write with the new state size

    def for_layer(self, name: str, kv_cache: Tensor) -> SideStore:
        """The layer's store, (re)allocated for ``kv_cache`` if it does not fit it."""
        side = self.by_layer.get(name)
        if side is None or side.pos.shape != kv_cache.shape[:3]:
            side = self.by_layer[name] = SideStore.like(kv_cache, self.state_size)
        return side

    def __getitem__(self, name: str) -> SideStore:
        return self.by_layer[name]
