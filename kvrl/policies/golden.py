"""Golden Eviction: ForesightKV's oracle, which knows the attention the future will pay.

Contract: :func:`block_attention` runs one full-cache forward over a whole trace and
returns, per (layer, KV head), the attention every key receives from each eviction block
of queries; :class:`GoldenEviction` is a :class:`~kvrl.policies.KVPolicy` whose keep-score
for a cached key is the largest attention any *future* block pays it. Replayed by
:class:`kvrl.envs.eviction.ChunkedPass`, it gives the eviction trace the learned scorers
are supervised on (stage 1) and the loss ratio they are measured against (a lower bound in
practice, not a proven optimum: it looks at full-cache attention, not at the compressed one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvrl.policies.base import KVPolicy, Observation


def block_bounds(length: int, prompt_len: int, interval: int) -> list[int]:
    """Ends of the eviction blocks of a trace: the prompt, then every ``interval`` tokens
    (the last block may be shorter). The same blocks as the chunked teacher-forced pass."""
    if not 0 < prompt_len <= length:
        raise ValueError(f"prompt_len={prompt_len} must be in 1..{length} (the trace length)")
    return [*range(prompt_len, length, interval), length]


@torch.no_grad()
def block_attention(model, ids: Tensor, prompt_len: int, interval: int) -> tuple[Tensor, Tensor]:
    """Full-cache attention of each block of queries to every key (ForesightKV's oracle input).

    ids [T] token ids of one trace. Returns ``blocks`` [layers, H_kv, n_blocks, T] float32 —
    the softmax attention averaged over the block's queries and over the query heads of each
    KV head's GQA group (methods.md §4) — and ``starts`` [n_blocks] int64, the first
    position of each block (:func:`block_bounds`).
    """
    cfg = model.config
    T = ids.shape[-1]
    ends = block_bounds(T, prompt_len, interval)
    starts = torch.tensor([0, *ends[:-1]])
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only implementation that returns the weights
    try:
        out = model(input_ids=ids.view(1, T).to(model.device), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    block_of = torch.bucketize(torch.arange(T), torch.tensor(ends), right=True)  # query -> block
    counts = torch.bincount(block_of, minlength=len(ends)).clamp(min=1).float()
    blocks = []
    for attn in out.attentions:  # [1, Hq, T, T]
        a = attn[0].float().view(cfg.num_key_value_heads, g, T, T).mean(1)  # [H, T(q), T(k)]
        summed = torch.zeros(a.shape[0], len(ends), T).index_add_(1, block_of.to(a.device), a.cpu())
        blocks.append(summed / counts[None, :, None])
    return torch.stack(blocks), starts


@dataclass(kw_only=True)
class GoldenEviction(KVPolicy):
    """ForesightKV's Golden Eviction (RUCAIBox/ForesightKV ``supervised_training``; seed 004 §3).

    At an eviction step ending at position e, a cached key k is scored by
    ``max_{blocks j starting ≥ e} blocks[layer, head, j, k]``, the most attention any future
    block of queries pays it under the full cache; the lowest are evicted (0 when no future
    block remains). ForesightKV's supervision targets are the negatives of these scores.

    Parameters
    ----------
    blocks : Tensor [layers, H_kv, n_blocks, T]
        From :func:`block_attention` for the one trace (batch 1) this policy replays.
    starts : Tensor [n_blocks] int64
        First position of each block.
    budget, interval, window, sink : int
        As :class:`KVPolicy`; ``interval`` must be the one ``blocks`` was built with.
    """

    blocks: Tensor = field(repr=False)
    starts: Tensor = field(repr=False)

    def score(self, obs: Observation) -> tuple[Tensor, None]:
        if obs.key_pos.shape[0] != 1:
            raise ValueError(f"GoldenEviction replays one trace; got a batch of {obs.key_pos.shape[0]}")
        end = int(obs.query_pos[0, -1]) + 1
        future = self.blocks[obs.layer][:, self.starts >= end]  # [H, F, T]
        best = future.amax(1) if future.shape[1] else torch.zeros_like(self.blocks[obs.layer][:, 0])
        pos = obs.key_pos[0].clamp(min=0).cpu()
        return best.gather(-1, pos)[None].to(obs.keys.device), None
