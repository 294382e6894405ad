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
   (checked equal): the difference is only where the mask comes from. The two take turns
   (``--repeats`` each); the median wall time of each, and every run's CPU and wall
   seconds (mean, min, max: ``seconds``).

The death times are a synthetic G-KV-like pattern (:func:`kvrl.bench.synthetic_death`).

    python benchmarks/system/replay_memory.py [--seq 2048] [--repeats 3]
"""

import argparse
import statistics

import torch

from kvrl.bench import emit, interleaved, reasoner, register_dense_masks, synthetic_death
from kvrl.cache import EvictionTrace
from kvrl.kernels.reference.replay import visibility
from kvrl.runlog import setup_process

QWEN_7B = {"layers": 28, "kv_heads": 4}
LENGTHS = {"4K": 4096, "8K": 8192, "16K": 16384}
DENSE_MEASURED = ("4K", "8K")  # one layer of dense masks: 64 MiB and 256 MiB


def memory_figures() -> dict:
    L, H = QWEN_7B["layers"], QWEN_7B["kv_heads"]
    out = {}
    for name, T in LENGTHS.items():
        trace = EvictionTrace.from_death(synthetic_death(L, H, T), torch.tensor([T]))
        row = {
            "trace_bytes": trace.death.numel() * trace.death.element_size(),
            "trace_dtype": str(trace.death.dtype),
            "dense_bytes_from_shape": L * H * T * T,
        }
        if name in DENSE_MEASURED:
            pos = torch.arange(T)[None]
            one_layer = visibility(trace.full()[0], pos, pos)  # [1, H, T, T] bool
            row["dense_bytes_one_layer_measured_x_layers"] = one_layer.numel() * one_layer.element_size() * L
            del one_layer
        row["dense_over_trace"] = round(row["dense_bytes_from_shape"] / row["trace_bytes"], 1)
        out[name] = row
    return out


def step(model, ids, pos, attention: str, **attn) -> torch.Tensor:
    """One forward + backward under ``attention``; its logits."""
    model.set_attn_implementation(attention)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, **attn).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    setup_process()
    memory = memory_figures()

    model, _, _ = reasoner("tiny")
    model.train()
    cfg, T = model.config, args.seq
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    pos = torch.arange(T)[None]
    trace = EvictionTrace.from_death(
        synthetic_death(cfg.num_hidden_layers, cfg.num_key_value_heads, T), torch.tensor([T])
    )

    replay = trace.replay(pos, flex=False)
    full = trace.full()
    dense = torch.stack([visibility(full[layer], pos, pos) for layer in range(cfg.num_hidden_layers)])
    dense_attention = register_dense_masks()
    runs = interleaved(
        {
            "replay": lambda: step(model, ids, pos, "kvrl_replay", kvrl_replay=replay),
            "dense_mask": lambda: step(model, ids, pos, dense_attention, dense_masks=dense),
        },
        args.repeats,
    )
    replay_s, dense_s = (statistics.median_high(runs[k].wall_s) for k in ("replay", "dense_mask"))
    replay_logits, dense_logits = runs["replay"].outs[-1], runs["dense_mask"].outs[-1]

    emit(
        {
            "benchmark": "replay_memory",
            "memory_qwen7b_per_sequence": {"shape": QWEN_7B, **memory},
            "learner_step_tiny": {
                "seq": T,
                "layers": cfg.num_hidden_layers,
                "kv_heads": cfg.num_key_value_heads,
                "repeats": args.repeats,
                "replay_s": round(replay_s, 3),
                "dense_mask_s": round(dense_s, 3),
                "replay_over_dense_time": round(replay_s / dense_s, 3),
                "replay_record_bytes": trace.death.numel() * trace.death.element_size(),
                "dense_record_bytes": dense.numel() * dense.element_size(),
                "logits_max_abs_diff": (replay_logits - dense_logits).abs().max().item(),
                "seconds": {k: r.summary(3) for k, r in runs.items()},
            },
        }
    )


if __name__ == "__main__":
    main()
