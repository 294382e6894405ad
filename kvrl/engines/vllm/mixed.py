"""The ``Mixed`` regime on a vLLM worker: RLKV's mixed-gate attention (:class:`kvrl.policies.regime.Mixed`).

Every head keeps the full cache (vLLM's write, slot = position). One-token rows: the full
branch through the layout's kernel for all rows and heads at once, the sink + recent branch
over the gathered window slots (one batched SDPA), mixed per KV head; prompt chunks through
:func:`kvrl.kernels.reference.mixed.mixed_gate_attention` (torch). The gates are read from the
installed regime at every layer, so a pushed state (``Mixed.load_state``) applies at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvrl.engines.vllm.steps import LayerCall, RegimeWorker, StepInput, StepPlan, WindowPlan
from kvrl.kernels.reference.mixed import mixed_gate_attention
from kvrl.policies.regime import Mixed


class MixedWorker(RegimeWorker):
    def __init__(self, regime: Mixed):
        self.mixed = regime

    def plan(self, plan: StepPlan, step: StepInput) -> None:
        plan.window = WindowPlan.of(plan.rows, step.cm.block_table_tensor, self.mixed.sink, self.mixed.recent)

    def attention(self, call: LayerCall) -> None:
        mg, wp, query, output = self.mixed, call.plan.window, call.query, call.output
        if wp.decode.numel():
            q = query[: wp.decode.numel()] if wp.all_decode else query.index_select(0, wp.decode)
            wp.put(output, self._decode(call, q))
        for row in wp.multi:
            k, v = call.layout.read(call.kv_cache, row.blocks[None], row.m)
            qpos = call.plan.positions[row.start : row.start + row.q]
            q = query[row.start : row.start + row.q].transpose(0, 1)[None]
            out = mixed_gate_attention(
                q,
                k,
                v,
                qpos[None],
                torch.arange(row.m, device=q.device)[None],
                mg.gates[call.index],
                sink=mg.sink,
                recent=mg.recent,
                scaling=call.scale,
            )
            output[row.start : row.start + row.q] = out[0].transpose(0, 1).to(output.dtype)

    def _decode(self, call: LayerCall, q: Tensor) -> Tensor:
        """Mixed gates for one-token rows q [R, Hq, D]: α·(every slot, the layout's kernel) +
        (1 − α)·(the sink slots and the last ``recent``, gathered) per KV head, as
        :func:`kvrl.kernels.reference.mixed.mixed_gate_attention` computes it."""
        mg, wp, layout, kv_cache, scale = self.mixed, call.plan.window, call.layout, call.kv_cache, call.scale
        h = kv_cache.shape[1]
        full = layout.head_attention(q, kv_cache, wp.blocks, wp.m[:, None].expand(-1, h), scale)
        w = torch.arange(mg.sink + mg.recent, device=q.device)
        m = wp.m[:, None]
        slots = torch.where(w < mg.sink, w, m - mg.recent + (w - mg.sink))  # [R, W]
        valid = (slots < m) & ((w < mg.sink) | (slots >= mg.sink))  # each slot once, none past m
        k, v = layout.gather(kv_cache, wp.blocks, slots.clamp(min=0))
        group = q.shape[1] // h
        window = F.scaled_dot_product_attention(
            q[:, :, None], k.to(q.dtype), v.to(q.dtype), scale=scale, enable_gqa=True, attn_mask=valid[:, None, None, :]
        )[:, :, 0]
        alpha = mg.gates[call.index].to(q.device, torch.float32).repeat_interleave(group)[None, :, None]
        return alpha * full.float() + (1 - alpha) * window.float()


__all__ = ["MixedWorker"]
