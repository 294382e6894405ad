"""Every head set on the multihop reasoner: the best accuracy any head ranking could reach at a sparsity.

The multihop reasoner has 4 layers x 2 KV heads; at sparsity s, round(8s) of them keep 16 sink + 64
recent tokens (``tiny_multihop_rlkv``'s deployment window) and the rest the full cache. This decodes
``--tasks`` tasks of the validation stream (seed 7001: no test task) greedily on the head-reallocated
vLLM engine under every such set, and says where RLKV's gates (``--gates``, a trained run) and the 8
random draws of ``multihop_rlkv.py`` fall among them: a ranking can do no better than the best set, so
a low best set is a limit of the task at that window, not of the ranking.

Prints one JSON line: per sparsity, every set's accuracy (sorted), the best set, the sets' median,
and RLKV's set's accuracy and rank.

    python benchmarks/learning/multihop_head_sets.py [--sparsities 0.25,0.5] [--tasks 64]
"""

import argparse
import itertools
import os

import numpy as np
import torch
from transformers import AutoConfig

from kvrl.bench import VALIDATION_SEED, draw_tasks, emit
from kvrl.config import load_config
from kvrl.eval.budgets import evaluate
from kvrl.models.tiny import resolve_path
from kvrl.policies.heads import head_allocation, load_gates
from kvrl.runlog import setup_process


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sparsities", default="0.25,0.5")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--gates", default="outputs/multihop_rlkv/rlkv", help="a tiny_multihop_rlkv run (or gates file)")
    args = ap.parse_args()
    setup_process()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvrl.engines.vllm import VLLMEngine

    cfg = load_config(["recipe=tiny_multihop_rlkv"])
    sink, recent = cfg.rlkv.eval_sink, cfg.rlkv.eval_recent
    engine = VLLMEngine(resolve_path(cfg.model.path), dtype="float32", seed=0)
    config = AutoConfig.from_pretrained(resolve_path(cfg.model.path))
    shape = (config.num_hidden_layers, config.num_key_value_heads)
    heads = [(layer, h) for layer in range(shape[0]) for h in range(shape[1])]
    env, tasks = draw_tasks(cfg.env.id, args.tasks, VALIDATION_SEED)
    gates = load_gates(args.gates)

    def allocation(chosen):
        scores = torch.ones(shape)  # the chosen heads score lowest: they are the ones compressed
        for layer, h in chosen:
            scores[layer, h] = 0.0
        return head_allocation(scores, len(chosen) / len(heads), config, sink=sink, recent=recent)

    rows = {}
    for s in [float(x) for x in args.sparsities.split(",")]:
        k = round(s * len(heads))
        results = []
        for chosen in itertools.combinations(heads, k):
            alloc = allocation(chosen)
            assert sorted(map(tuple, alloc.compressed_mask().nonzero().tolist())) == sorted(chosen)
            results.append(
                {
                    "heads": [list(c) for c in chosen],
                    "acc": round(evaluate(engine, env, tasks, cfg.sampling.max_new_tokens, policy=alloc)["acc"], 4),
                }
            )
        results.sort(key=lambda r: -r["acc"])
        rlkv = sorted(
            map(list, head_allocation(gates, s, config, sink=sink, recent=recent).compressed_mask().nonzero().tolist())
        )
        rank = next(i for i, r in enumerate(results) if sorted(r["heads"]) == rlkv)
        rows[str(s)] = {
            "compressed": k,
            "sets": len(results),
            "best": results[0],
            "median_acc": float(np.median([r["acc"] for r in results])),
            "nonzero_sets": sum(r["acc"] > 0 for r in results),
            "rlkv": {"heads": rlkv, "acc": results[rank]["acc"], "rank": rank + 1},
            "all": results,
        }
    emit(
        {
            "benchmark": "multihop_head_sets",
            "model": cfg.model.path,
            "window": {"sink": sink, "recent": recent},
            "stream": "validation",
            "stream_seed": VALIDATION_SEED,
            "tasks": len(tasks),
            "gates": [[round(v, 4) for v in row] for row in gates.tolist()],
            "sparsities": rows,
        }
    )


if __name__ == "__main__":
    main()
