"""What replaying an eviction trace costs the learner: death times vs dense masks.

Two measurements side by side, one JSON line:

1. **Memory** of one sequence's eviction record for a DeepSeek-R1-Distill-Qwen-7B shape
   (28 layers, 4 KV heads) at T = 4K / 8K / 16K tokens: kvrl's
   :class:`kvrl.cache.EvictionTrace` (death time per (layer, KV head, key): O(L·H·T)
   integers, int16 below 32K) versus the reference's dense per-head T×T bool masks
   (``build_sparse_mask_from_pos_cache``: O(L·H·T²)). Both are built as real tensors where
   they fit: the trace always; the dense masks of one layer (built from the trace with
   :func:`kvrl.kernels.reference.replay.visibility`) at 4K and 8K, times the layers; at 16K one
   layer alone would be 1 GiB, so that column is computed from the shape.
2. **Learner step time** (forward + backward of the tiny reasoner on one long sequence)
   with the replay attention (``"kvrl_replay"``: each layer's mask derived from the death
   times during the forward, then dropped) versus an attention that reads precomputed
   dense per-layer masks, as the reference trains. Same SDPA kernel, same visibility
   (checked equal): the difference is only where the mask comes from.

The death times are a synthetic G-KV-like pattern (sink 4, recent window, each older key
dying at a random later query); cost does not depend on which keys die.

    python benchmarks/replay_memory.py [--seq 2048] [--repeats 3]
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvrl.cache import EvictionTrace
from kvrl.kernels.reference.replay import NEVER, visibility
from kvrl.models.tiny import load_model

QWEN_7B = {"layers": 28, "kv_heads": 4}
LENGTHS = {"4K": 4096, "8K": 8192, "16K": 16384}
DENSE_MEASURED = ("4K", "8K")  # one layer of dense masks: 64 MiB and 256 MiB


def synthetic_death(layers: int, heads: int, T: int, sink: int = 4, recent: int = 16, seed: int = 0) -> torch.Tensor:
    """[layers, 1, heads, T] int32: sink never dies, each other key dies at a random query
    in (k + recent, T], or never (about a quarter of them)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.arange(T)
    death = k + recent + (torch.rand(layers, 1, heads, T, generator=g) * (T - k)).long()
    death = torch.where(torch.rand(layers, 1, heads, T, generator=g) < 0.25, NEVER, death)
    return death.masked_fill(k < sink, NEVER).clamp(max=NEVER).int()


def memory_figures() -> dict:
    L, H = QWEN_7B["layers"], QWEN_7B["kv_heads"]
    out = {}
    for name, T in LENGTHS.items():
        trace = EvictionTrace.from_death(synthetic_death(L, H, T), torch.tensor([T]))
        row = {"trace_bytes": trace.death.numel() * trace.death.element_size(), "trace_dtype": str(trace.death.dtype),
               "dense_bytes_from_shape": L * H * T * T}
        if name in DENSE_MEASURED:
            pos = torch.arange(T)[None]
            one_layer = visibility(trace.full()[0], pos, pos)  # [1, H, T, T] bool
            row["dense_bytes_one_layer_measured_x_layers"] = one_layer.numel() * one_layer.element_size() * L
            del one_layer
        row["dense_over_trace"] = round(row["dense_bytes_from_shape"] / row["trace_bytes"], 1)
        out[name] = row
    return out


def dense_mask_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0,
                         dense_masks=None, **kwargs):
    """The reference's training attention: a stored [layers, B, H_kv, T, T] bool mask."""
    groups = query.shape[1] // key.shape[1]
    mask = dense_masks[module.layer_idx].repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("bench_dense_mask", dense_mask_attention)


def step_time(model, ids, pos, repeats: int, **attn) -> tuple[float, torch.Tensor]:
    """Median seconds of forward + backward, and the logits of the last run."""
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = model(input_ids=ids, position_ids=pos, **attn).logits
        logits.float().logsumexp(-1).mean().backward()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], logits.detach()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    memory = memory_figures()

    model, _ = load_model("tiny")
    model.train()
    cfg, T = model.config, args.seq
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    pos = torch.arange(T)[None]
    trace = EvictionTrace.from_death(synthetic_death(cfg.num_hidden_layers, cfg.num_key_value_heads, T), torch.tensor([T]))

    model.set_attn_implementation("kvrl_replay")
    replay_s, replay_logits = step_time(model, ids, pos, args.repeats, kvrl_replay=trace.replay(pos, flex=False))

    full = trace.full()
    dense = torch.stack([visibility(full[layer], pos, pos) for layer in range(cfg.num_hidden_layers)])
    model.set_attn_implementation("bench_dense_mask")
    dense_s, dense_logits = step_time(model, ids, pos, args.repeats, dense_masks=dense)

    print(json.dumps({
        "benchmark": "replay_memory",
        "memory_qwen7b_per_sequence": {"shape": QWEN_7B, **memory},
        "learner_step_tiny": {
            "seq": T, "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads, "repeats": args.repeats,
            "replay_s": round(replay_s, 3), "dense_mask_s": round(dense_s, 3),
            "replay_over_dense_time": round(replay_s / dense_s, 3),
            "replay_record_bytes": trace.death.numel() * trace.death.element_size(),
            "dense_record_bytes": dense.numel() * dense.element_size(),
            "logits_max_abs_diff": (replay_logits - dense_logits).abs().max().item(),
        },
    }))


if __name__ == "__main__":
    main()
