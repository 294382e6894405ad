"""The ``Static`` regime on a vLLM worker: a fixed death pattern (:class:`kvrl.policies.regime.Static`).

Request i reads row ``kvrl_index`` = i of the pattern. What the pattern is decides, once
when the regime is installed (:func:`static_worker`), how its heads are kept:

* a sink + recent pattern (:func:`window_heads`: RLKV's heads, a ``Window``) —
  :class:`WindowWorker`. On the CPU backend the request's blocks are pooled
  (:class:`kvrl.engines.vllm.layout.HeadPool`): a windowed head keeps its window as a
  ring of ⌈(sink + recent) / bs⌉ (block, head) regions, the full heads share the rest, so
  at sparsity s a request holds about (1 − s) of the full cache's blocks (the KV manager
  allocates no more, so more requests run at once); one-token rows attend through vLLM's
  own CPU kernel with every (request, KV head) a sequence over its regions, prompt chunks
  with the pattern's mask (torch). Without pooling (the CUDA layout interleaves the heads
  within a block) every head keeps vLLM's slot = position and a windowed head its ring in
  its first slots (:class:`kvrl.engines.vllm.steps.WindowPlan`).
* any other pattern (death tensors, oracle patterns) — :class:`StaticWorker`: heads have
  their own lengths; keys are dropped once no later query can see them, and attention over
  the packed per-head caches (positions in the side stores) uses the pattern's mask (torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvrl.engines.vllm.layout import HeadPool, SideStores
from kvrl.engines.vllm.steps import LayerCall, RegimeWorker, ReqState, RowPlan, StepInput, StepPlan, WindowPlan
from kvrl.policies.regime import Static


def window_heads(pattern) -> tuple[Tensor, int, int] | None:
    """(windowed [L, H] bool, sink, recent) of a sink + recent pattern — a
    :class:`kvrl.policies.HeadAllocation` or :class:`kvrl.policies.Window` — else None
    (death tensors, oracle patterns: the general static path)."""
    from kvrl.policies.heads import HeadAllocation, Window

    if isinstance(pattern, HeadAllocation):
        return pattern.compressed_mask().cpu(), pattern.sink, pattern.recent
    if isinstance(pattern, Window):
        return torch.ones(pattern.layers, pattern.kv_heads, dtype=torch.bool), pattern.sink, pattern.recent
    return None


def static_worker(regime: Static, geometry: tuple[int, int], sides: SideStores) -> StaticWorker:
    """The worker of a static pattern: a :class:`WindowWorker` for a sink + recent one."""
    windows = window_heads(regime.pattern)
    return StaticWorker(regime, geometry, sides) if windows is None else WindowWorker(regime, geometry, windows)


class StaticWorker(RegimeWorker):
    """Any death pattern: every head appends at its own length and drops what no later query sees."""

    def __init__(self, regime: Static, geometry: tuple[int, int], sides: SideStores | None = None):
        self.static, self.geometry, self.sides = regime, geometry, sides

    def admit(self, req: ReqState) -> None:
        layers, heads = self.geometry
        req.death = self.static.row(req.index, req.length - 1)  # covers prompt + max_tokens, as the engine's T
        if req.death.shape[:2] != (layers, heads):
            raise ValueError(
                f"death pattern of shape {tuple(req.death.shape)}, the model has (layers, kv_heads) = {(layers, heads)}"
            )
        req.lens = torch.zeros(layers, heads, dtype=torch.long)

    def plan(self, plan: StepPlan, step: StepInput) -> None:
        for row in plan.rows:  # lens: updated by the layers
            row.lens = row.req.lens.clone()

    def kv_update(self, call: LayerCall) -> None:
        layout, kv_cache, key, value = call.layout, call.kv_cache, call.key, call.value
        side = self.sides.for_layer(call.name, kv_cache)
        h, dev = kv_cache.shape[1], kv_cache.device
        for row in call.plan.rows:
            lens = row.lens[call.index].to(dev)  # [H]
            j = torch.arange(row.q, device=dev)
            slots = (lens[:, None] + j[None, :]).reshape(-1)
            heads = torch.arange(h, device=dev).repeat_interleave(row.q)
            toks = j.repeat(h) + row.start
            zero = torch.zeros_like(heads)
            layout.write(kv_cache, row.blocks[None], zero, heads, slots, key[toks, heads], value[toks, heads])
            side.write(row.blocks[None], zero, heads, slots, call.plan.positions[toks], None)

    def attention(self, call: LayerCall) -> None:
        plan, layer_idx, layout, kv_cache = call.plan, call.index, call.layout, call.kv_cache
        query, output = call.query, call.output
        side = self.sides[call.name]
        h = kv_cache.shape[1]
        group = query.shape[1] // h
        for row in plan.rows:
            st = row.req
            dev = kv_cache.device
            lens = (row.lens[layer_idx] + row.q).to(dev)  # [H] after this forward's appends
            n = int(lens.max())
            blocks = row.blocks[None]
            keys, values = layout.read(kv_cache, blocks, n)
            pos, _ = side.read(blocks, n)
            keys, values, pos = keys[0], values[0], pos[0]
            pos = pos.masked_fill(torch.arange(n, device=dev)[None, :] >= lens[:, None], -1)
            death = st.death[layer_idx].to(dev).gather(-1, pos.clamp(min=0)).long()  # [H, N]
            qpos = plan.positions[row.start : row.start + row.q]
            k = pos[:, None, :]
            qq = qpos[None, :, None]
            allowed = (k >= 0) & (k <= qq) & (qq < death[:, None, :])  # [H, Q, N]
            q = query[row.start : row.start + row.q].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                q,
                keys[None],
                values[None],
                attn_mask=allowed.repeat_interleave(group, dim=0)[None],
                scale=call.scale,
                enable_gqa=True,
            )
            output[row.start : row.start + row.q] = out[0].transpose(0, 1).to(output.dtype)
            # drop the keys no later query can see (death <= m), per head, keeping order
            alive = (pos >= 0) & (death > row.m)
            new_lens = alive.sum(-1)
            st.lens[layer_idx] = new_lens.cpu()
            changed = (new_lens != lens).nonzero().squeeze(-1)
            for hh in changed.tolist():
                idx = alive[hh].nonzero().squeeze(-1)
                heads = torch.full_like(idx, hh)
                slots = torch.arange(idx.numel(), device=dev)
                zero = torch.zeros_like(idx)
                layout.write(kv_cache, blocks, zero, heads, slots, keys[hh, idx], values[hh, idx])
                side.write(blocks, zero, heads, slots, pos[hh, idx], None)


class WindowWorker(StaticWorker):
    """A sink + recent pattern: vLLM's layout with each windowed head's window as a ring,
    pooled or not (see the module docstring)."""

    pools = True

    def __init__(self, regime: Static, geometry: tuple[int, int], windows: tuple[Tensor, int, int]):
        super().__init__(regime, geometry)
        self.windowed, self.sink, self.recent = windows
        # each layer's windowed and full heads, read at every write
        self.windowed_heads = [m.nonzero().squeeze(-1) for m in self.windowed]
        self.full_heads = [(~m).nonzero().squeeze(-1) for m in self.windowed]
        self.pool: HeadPool | None = None  # built for the block size at the first pooled step

    def plan(self, plan: StepPlan, step: StepInput) -> None:
        rows, bs = plan.rows, step.block_size
        wp = plan.window = WindowPlan.of(rows, step.cm.block_table_tensor, self.sink, self.recent)
        pooled = {r.req.pooled for r in rows}
        if len(pooled) > 1:
            raise RuntimeError(
                "a forward mixes requests with and without pooled heads; generate them in separate calls"
            )
        if pooled.pop():
            if self.pool is None or self.pool.block_size != bs:
                self.pool = HeadPool(self.windowed, self.sink, self.recent, bs)
            wp.pool, wp.all_blocks = self.pool, step.cm.block_table_tensor
            wp.decode_rows = torch.tensor(
                [i for i, r in enumerate(rows) if r.q == 1], dtype=torch.long, device=wp.all_blocks.device
            )
            wp.nblk = max(-(-max(r.m for r in rows) // bs), self.pool.ring_blocks)

    def kv_update(self, call: LayerCall) -> None:
        wp = call.plan.window
        if wp.pool is not None:
            self._pool_write(call)
            return
        call.stock()  # vLLM's own slots; then the one-token rows' windowed heads into their rings
        rows = (wp.ring >= 0).nonzero().squeeze(-1)
        heads = self.windowed_heads[call.index].to(call.kv_cache.device)
        if rows.numel() and heads.numel():
            r, hh = rows.repeat_interleave(heads.numel()), heads.repeat(rows.numel())
            tok = wp.decode[r]
            call.layout.write(call.kv_cache, wp.blocks, r, hh, wp.ring[r], call.key[tok, hh], call.value[tok, hh])

    def attention(self, call: LayerCall) -> None:
        if call.plan.window.pool is not None:
            self._pool_attention(call)
        else:
            self._window_attention(call)

    def _pool_tables(self, wp: WindowPlan, kv_cache: Tensor) -> None:
        """The step's region ids (the same for every layer), at its first layer: the layer's
        cache tensor says how many blocks a layer has."""
        pool, bs = wp.pool, kv_cache.shape[2]
        wp.table = pool.table(wp.all_blocks, wp.nblk, kv_cache.shape[0])
        slots = pool.slots(wp.m - 1)  # [Rd, L, H]
        wp.decode_table = wp.table[wp.decode_rows]
        region = wp.decode_table.gather(-1, (slots // bs)[..., None]).squeeze(-1)
        wp.write_at = (region, slots % bs)

    def _pool_write(self, call: LayerCall) -> None:
        """Pooled heads: a one-token row's new key in every head at its slot (vLLM's write,
        which would put every head at slot = position, is skipped); a prompt chunk's keys
        in its full heads (its windowed heads' go to their rings after the chunk's attention,
        which still reads the window they overwrite)."""
        wp, layer_idx, layout, kv_cache = call.plan.window, call.index, call.layout, call.kv_cache
        key, value = call.key, call.value
        if wp.table is None:
            self._pool_tables(wp, kv_cache)
        regions = layout.regions(kv_cache, layer_idx)
        d = key.shape[-1]
        if wp.decode.numel():
            region, offset = wp.write_at
            k, v = (
                (key[: wp.decode.numel()], value[: wp.decode.numel()])
                if wp.all_decode
                else (key.index_select(0, wp.decode), value.index_select(0, wp.decode))
            )
            layout.region_write(
                regions,
                region[:, layer_idx].reshape(-1),
                offset[:, layer_idx].reshape(-1),
                k.reshape(-1, d),
                v.reshape(-1, d),
            )
        full = self.full_heads[layer_idx].to(kv_cache.device)
        bs = kv_cache.shape[2]
        for i, row in zip(wp.multi_rows, wp.multi):
            p = torch.arange(row.done, row.m, device=kv_cache.device)
            region = wp.table[i, layer_idx, full][:, p // bs]  # [F, q]
            span = slice(row.start, row.start + row.q)
            layout.region_write(
                regions,
                region.reshape(-1),
                (p % bs).repeat(full.numel()),
                key[span, full].transpose(0, 1).reshape(-1, d),
                value[span, full].transpose(0, 1).reshape(-1, d),
            )

    def _window_attention(self, call: LayerCall) -> None:
        wp, layer_idx, layout, kv_cache, query = call.plan.window, call.index, call.layout, call.kv_cache, call.query
        sink, recent = self.sink, self.recent
        windowed = self.windowed[layer_idx].to(kv_cache.device)
        if wp.decode.numel():
            lens = torch.where(windowed[None, :], wp.m.clamp(max=sink + recent)[:, None], wp.m[:, None])
            q = query[: wp.decode.numel()] if wp.all_decode else query.index_select(0, wp.decode)
            wp.put(call.output, layout.head_attention(q, kv_cache, wp.blocks, lens, call.scale))
        for row in wp.multi:  # sink + recent mask over the stock layout (ring slots hold only dead keys)
            k, v = layout.read(kv_cache, row.blocks[None], row.m)
            self._chunk_attention(call, row, windowed, k, v)
            # the last `recent` new keys of the windowed heads into their rings, after the attention
            heads = self.windowed_heads[layer_idx].to(k.device)
            first = max(row.done, row.m - recent, sink + recent)
            if heads.numel() and first < row.m:
                p = torch.arange(first, row.m, device=k.device)
                hh, pp = heads.repeat_interleave(p.numel()), p.repeat(heads.numel())
                layout.write(
                    kv_cache,
                    row.blocks[None],
                    torch.zeros_like(hh),
                    hh,
                    sink + (pp - sink) % recent,
                    k[0, hh, pp],
                    v[0, hh, pp],
                )

    def _chunk_attention(self, call: LayerCall, row: RowPlan, windowed: Tensor, k: Tensor, v: Tensor) -> None:
        """A prompt chunk's queries over keys ``k``/``v`` [1, H, m, D] at positions 0..m−1
        (a windowed head's dead ones may hold anything) with the pattern's mask."""
        sink, recent = self.sink, self.recent
        qpos = torch.arange(row.done, row.m, device=k.device)
        kpos = torch.arange(row.m, device=k.device)
        causal = kpos[None, :] <= qpos[:, None]
        window = causal & ((kpos[None, :] < sink) | (qpos[:, None] < kpos[None, :] + recent))
        mask = torch.where(windowed[:, None, None], window[None], causal[None])  # [H, Q, N]
        q = call.query[row.start : row.start + row.q].transpose(0, 1)[None]
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            scale=call.scale,
            enable_gqa=True,
            attn_mask=mask.repeat_interleave(group, dim=0)[None],
        )
        call.output[row.start : row.start + row.q] = out[0].transpose(0, 1).to(call.output.dtype)

    def _pool_attention(self, call: LayerCall) -> None:
        """Pooled heads: one-token rows through the layout's kernel over their heads' regions
        (a full head's m slots, a windowed head's min(m, sink + recent)); a prompt chunk
        over its full heads' slots and its windowed heads' rings put back at their
        positions, plus the chunk's own keys; then the chunk's windowed keys into the rings."""
        wp, layer_idx, layout, kv_cache = call.plan.window, call.index, call.layout, call.kv_cache
        key, value = call.key, call.value
        sink, recent = self.sink, self.recent
        windowed = self.windowed[layer_idx].to(kv_cache.device)
        regions = layout.regions(kv_cache, layer_idx)
        if wp.decode.numel():
            lens = torch.where(windowed[None, :], wp.m.clamp(max=sink + recent)[:, None], wp.m[:, None])
            q = call.query[: wp.decode.numel()] if wp.all_decode else call.query.index_select(0, wp.decode)
            wp.put(call.output, layout.region_attention(q, regions, wp.decode_table[:, layer_idx], lens, call.scale))
        win = self.windowed_heads[layer_idx].to(kv_cache.device)
        bs, dev = kv_cache.shape[2], kv_cache.device
        for i, row in zip(wp.multi_rows, wp.multi):
            table = wp.table[i, layer_idx]  # [H, nblk]
            k, v = layout.region_read(regions, table, row.m)  # full heads: slot = position, this chunk's too
            span = slice(row.start, row.start + row.q)
            if win.numel():
                # slot s of a windowed head holds position s below sink, else the last p < done with
                # p ≡ s (mod recent); the chunk's keys are in hand
                s = torch.arange(min(row.done, sink + recent), device=dev)
                p = torch.where(s < sink, s, s + (row.done - 1 - s).div(recent, rounding_mode="floor") * recent)
                kw, vw = k.new_zeros(win.numel(), *k.shape[1:]), v.new_zeros(win.numel(), *v.shape[1:])
                kw[:, p], vw[:, p] = k[win][:, s], v[win][:, s]
                kw[:, row.done :], vw[:, row.done :] = key[span, win].transpose(0, 1), value[span, win].transpose(0, 1)
                k, v = k.index_copy(0, win, kw), v.index_copy(0, win, vw)
            self._chunk_attention(call, row, windowed, k[None], v[None])
            # the chunk's windowed keys a later query sees (sinks and the last `recent`) into the rings
            p = torch.arange(row.done, row.m, device=dev)
            p = p[(p < sink) | (p >= row.m - recent)]
            if win.numel() and p.numel():
                slot = torch.where(p >= sink + recent, sink + (p - sink) % recent, p)
                region = table[win][:, slot // bs]  # [W, n]
                layout.region_write(
                    regions,
                    region.reshape(-1),
                    (slot % bs).repeat(win.numel()),
                    key[row.start + p - row.done][:, win].transpose(0, 1).reshape(-1, k.shape[-1]),
                    value[row.start + p - row.done][:, win].transpose(0, 1).reshape(-1, v.shape[-1]),
                )


__all__ = ["StaticWorker", "WindowWorker", "static_worker", "window_heads"]
