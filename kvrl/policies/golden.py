"""Golden Eviction: ForesightKV's oracle, which knows the attention the future will pay.

Contract: :func:`record_attention` runs one full-cache forward over a whole trace and keeps,
per layer, the post-RoPE queries and keys and each query's full-cache log-sum-exp
(:class:`FullAttention`, O(T) per layer: no T×T map is ever built, and no
[blocks × T] table either). :class:`GoldenEviction` is a :class:`~kvrl.policies.KVPolicy`
whose keep-score for a cached key is the largest attention any *future* block of queries
pays it under the full cache, computed at each eviction step for the cached keys only,
``chunk`` future queries at a time. Replayed by :class:`kvrl.envs.eviction.ChunkedPass`, it
gives the eviction trace the learned scorers are supervised on (stage 1) and the loss ratio
they are measured against (a lower bound in practice, not a proven optimum: it looks at
full-cache attention, not at the compressed one).

Cost: memory per layer O(T·(H_q + H_kv)·D) for the record, plus O(H_q·chunk·T) transient
in the forward and O(H_q·chunk·N) per score call (N cached keys). Compute: the forward is
full attention; each eviction step scores its N cached keys against every future query,
O(steps·N·T·H_q·D) in all — more arithmetic than materialising the T×T maps once, traded
for memory that stays linear in T.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from kvrl.policies.base import KVPolicy, Observation


def block_bounds(length: int, prompt_len: int, interval: int) -> list[int]:
    """Ends of the eviction blocks of a trace: the prompt, then every ``interval`` tokens
    (the last block may be shorter). The same blocks as the chunked teacher-forced pass."""
    if not 0 < prompt_len <= length:
        raise ValueError(f"prompt_len={prompt_len} must be in 1..{length} (the trace length)")
    return [*range(prompt_len, length, interval), length]


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@dataclass
class FullAttention:
    """What Golden Eviction reads from one full-cache forward over one trace.

    Per layer: ``queries`` [H_kv, G, T, D] post-RoPE (query head h·G+i is ``[h, i]``, as
    transformers' ``repeat_kv``), ``keys`` [H_kv, T, D] post-RoPE, ``lse`` [H_kv, G, T]
    float32 (float64 for float64 models): ``log Σ_{k ≤ q} exp(q·k·scaling)`` of each query
    over the full causal cache, and ``scaling``. ``ends``: the eviction blocks
    (:func:`block_bounds`). Attention of query q to key k ≤ q is ``exp(q·k·scaling − lse[q])``.
    """

    queries: list = field(default_factory=list, repr=False)
    keys: list = field(default_factory=list, repr=False)
    lse: list = field(default_factory=list, repr=False)
    scaling: list = field(default_factory=list)
    ends: list = field(default_factory=list)
    chunk: int = 256  # queries per step of the recording forward
    device: torch.device | None = None  # where the record is kept (None: the model's device)
    _blocks: dict = field(default_factory=dict, repr=False)  # device -> (block_of, counts)

    @property
    def starts(self) -> Tensor:
        """[n_blocks] int64, the first position of each block."""
        return torch.tensor([0, *self.ends[:-1]])

    def blocks(self, device) -> tuple[Tensor, Tensor]:
        """(block of each position [T] int64, queries per block [n_blocks] int64) on device."""
        key = str(device)
        if key not in self._blocks:
            block_of = torch.bucketize(torch.arange(self.ends[-1]), torch.tensor(self.ends), right=True)
            counts = torch.bincount(block_of, minlength=len(self.ends)).clamp(min=1)
            self._blocks[key] = block_of.to(device), counts.to(device)
        return self._blocks[key]

    def record(self, layer: int, query: Tensor, key: Tensor, lse: Tensor, scaling: float) -> None:
        while len(self.queries) <= layer:
            self.queries.append(None), self.keys.append(None), self.lse.append(None), self.scaling.append(None)
        dev = self.device or query.device
        self.queries[layer], self.keys[layer] = query.to(dev), key.to(dev)
        self.lse[layer], self.scaling[layer] = lse.to(dev), float(scaling)


def golden_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    scaling,
    dropout=0.0,
    kvrl_golden: FullAttention | None = None,
    **kwargs,
):
    """transformers attention function ``"kvrl_golden"``: causal full attention of one
    sequence, ``kvrl_golden.chunk`` queries at a time (no T×T tensor), recording the
    post-RoPE queries, keys and per-query log-sum-exp in ``kvrl_golden``.
    query [1, Hq, T, D], key/value [1, Hkv, T, D] -> (out [1, T, Hq, D], None)."""
    if kvrl_golden is None:
        raise ValueError("attn_implementation='kvrl_golden' needs model(..., kvrl_golden=FullAttention(...))")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"Golden Eviction records plain causal attention; this model's attention has {name}")
    B, Hq, T, D = query.shape
    H = key.shape[1]
    if B != 1 or key.shape[2] != T:
        raise ValueError(
            f"Golden Eviction records one full-sequence forward (batch 1, no cache); got queries "
            f"{tuple(query.shape)}, keys {tuple(key.shape)}"
        )
    g, dt = Hq // H, _math_dtype(query.dtype)
    q, k, v = query[0].reshape(H, g, T, D), key[0], value[0]
    out = torch.empty(H, g, T, value.shape[-1], dtype=query.dtype, device=query.device)
    lse = torch.empty(H, g, T, dtype=dt, device=query.device)
    pos = torch.arange(T, device=query.device)
    for q0 in range(0, T, kvrl_golden.chunk):
        q1 = min(q0 + kvrl_golden.chunk, T)
        # as transformers' eager attention: logits in the model dtype, softmax in float32
        s = (q[:, :, q0:q1] @ k[:, None, :q1].transpose(-1, -2)).mul_(scaling).to(dt)  # [H, g, c, q1]
        s[..., q0:].masked_fill_(pos[None, q0:q1] > pos[q0:q1, None], float("-inf"))  # causal (keys < q0: all seen)
        m = s.amax(-1, keepdim=True)
        total = s.sub_(m).exp_().sum(-1, keepdim=True)
        lse[:, :, q0:q1] = (m + total.log()).squeeze(-1)
        out[:, :, q0:q1] = s.div_(total).to(query.dtype) @ v[:, None, :q1]
        del s
    kvrl_golden.record(module.layer_idx, q, k, lse, scaling)
    return out.view(Hq, T, -1).transpose(0, 1)[None].contiguous(), None


@torch.no_grad()
def record_attention(
    model, ids: Tensor, prompt_len: int, interval: int, *, chunk: int = 256, device=None
) -> FullAttention:
    """One full-cache forward of the transformer body over one trace ids [T], recording
    what :class:`GoldenEviction` needs (:class:`FullAttention`), kept on ``device`` (default
    the model's). ``chunk``: queries per attention step of the forward (transient memory
    O(H_q·chunk·T) floats). Blocks are those of (prompt_len, interval)."""
    from transformers import AttentionInterface  # registered on first use; policies stay torch-only otherwise

    AttentionInterface.register("kvrl_golden", golden_attention)
    T = ids.shape[-1]
    rec = FullAttention(
        ends=block_bounds(T, prompt_len, interval),
        chunk=chunk,
        device=torch.device(device) if device is not None else None,
    )
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvrl_golden")
    try:  # the body only: the LM head's [T, V] logits are not needed
        model.get_decoder()(input_ids=ids.view(1, T).to(model.device), use_cache=False, kvrl_golden=rec)
    finally:
        model.set_attn_implementation(previous)
    if len(rec.queries) != model.config.num_hidden_layers or any(x is None for x in rec.queries):
        raise ValueError(
            "the forward did not record every layer's attention (a layer that is not "
            "transformers attention-interface attention?)"
        )
    return rec


def future_attention(att: FullAttention, layer: int, key_pos: Tensor, end: int, chunk: int = 1024) -> Tensor:
    """Golden keep-scores [H_kv, N] of keys at positions key_pos [H_kv, N] (≥ 0) for an
    eviction step ending at ``end``: ``max over blocks j starting ≥ end`` of the full-cache
    attention block j pays the key, averaged over the block's queries and the GQA group of
    each KV head; 0 when no block starts at or after ``end``. ``chunk`` future queries at a
    time: O(H_q·chunk·N) memory."""
    q, lse, scaling = att.queries[layer], att.lse[layer], att.scaling[layer]
    H, g, T, D = q.shape
    dev = q.device
    pos = key_pos.to(dev)
    k = att.keys[layer].gather(1, pos[..., None].expand(-1, -1, D))  # [H, N, D]
    kt = k.transpose(-1, -2)[:, None]  # [H, 1, D, N]
    best = torch.zeros(pos.shape, dtype=lse.dtype, device=dev)
    s0 = next((s for s in [0, *att.ends[:-1]] if s >= end), None)
    if s0 is None:
        return best
    block_of, counts = att.blocks(dev)
    ends = set(att.ends)
    carry = None  # summed attention of a block cut by the previous chunk's end
    for q0 in range(s0, T, chunk):
        q1 = min(q0 + chunk, T)
        a = (q[:, :, q0:q1] @ kt).mul_(scaling).to(lse.dtype).sub_(lse[:, :, q0:q1, None]).exp_()  # [H, g, c, N]
        a.masked_fill_(pos[:, None, None, :] > torch.arange(q0, q1, device=dev)[None, None, :, None], 0)
        first = bisect_right(att.ends, q0)  # block of query q0 (host-side: no device sync)
        m = bisect_right(att.ends, q1 - 1) - first + 1
        sums = torch.zeros(H, m, pos.shape[-1], dtype=a.dtype, device=dev).index_add_(
            1, block_of[q0:q1] - first, a.sum(1)
        )
        del a
        if carry is not None:
            sums[:, 0] += carry
        complete = m if q1 in ends else m - 1  # the last block goes on in the next chunk unless q1 ends it
        if complete:
            mean = sums[:, :complete] / (g * counts[first : first + complete].to(sums.dtype))[None, :, None]
            best = torch.maximum(best, mean.amax(1))
        carry = sums[:, -1] if complete < m else None
    return best


@dataclass(kw_only=True)
class GoldenEviction(KVPolicy):
    """ForesightKV's Golden Eviction (RUCAIBox/ForesightKV ``supervised_training``; arXiv 2602.03203 §3).

    At an eviction step ending at position e, a cached key k is scored by the most
    attention any future block of queries (block start ≥ e) pays it under the full cache,
    averaged over the block's queries and the query heads of the KV head's GQA group
    ; the lowest are evicted (0 when no future block remains). ForesightKV's
    supervision targets are the negatives of these scores.

    Parameters
    ----------
    attention : FullAttention
        From :func:`record_attention` for the one trace (batch 1) this policy replays, with
        this policy's ``interval``.
    chunk : int, default 1024
        Future queries scored at a time (memory O(H_q·chunk·N) per call).
    budget, interval, window, sink : int
        As :class:`KVPolicy`.
    """

    attention: FullAttention = field(repr=False)
    chunk: int = 1024
    reads: ClassVar[frozenset[str]] = frozenset({"layer"})  # the recorded future attention, not the cache

    def score(self, obs: Observation) -> tuple[Tensor, None]:
        if obs.key_pos.shape[0] != 1:
            raise ValueError(f"GoldenEviction replays one trace; got a batch of {obs.key_pos.shape[0]}")
        end = int(obs.query_pos[0, -1]) + 1
        best = future_attention(self.attention, obs.layer, obs.key_pos[0].clamp(min=0), end, self.chunk)
        return best[None].to(obs.key_pos.device), None
