"""Do RLKV's heads matter? Accuracy at a head sparsity with RLKV's, random and inverted heads full.

Loads the gates an RLKV run exported (``python -m kvrl.run recipe=tiny_rlkv`` writes
``outputs/tiny_rlkv/gates.safetensors``) and decodes the same held-out counts tasks
greedily with round(s·L·H) heads compressed to sink + recent (the rest keep the full
cache), the heads chosen:

* by RLKV's ranking (:func:`kvrl.algos.rlkv.head_allocation`: lowest gates compressed);
* at random (``--draws`` draws, each a uniformly random set of heads; mean and each draw);
* by the inverted ranking (highest gates compressed).

The default window (4 sink + 12 recent) is the tiny recipe's deployment window: the tiny
reasoner's sequences are ~100 tokens, so the paper's 16 + 64 would keep nearly all of
them. Decoding runs on the head-reallocated vLLM engine (``--engine hf`` for the
reference engine). Prints one JSON line.

    python benchmarks/learning/rlkv_heads.py [--gates outputs/tiny_rlkv] [--tasks 128] [--draws 8]
"""

import argparse
import os

import numpy as np
import torch

from kvrl.bench import draw_tasks, emit, reasoner
from kvrl.eval.budgets import evaluate
from kvrl.models.tiny import resolve_path
from kvrl.policies.heads import head_allocation, load_gates
from kvrl.runlog import setup_process


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gates", default="outputs/tiny_rlkv", help="an rlkv run's output_dir or gates file")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tasks", type=int, default=128)
    ap.add_argument("--draws", type=int, default=8, help="random head sets (at least 5)")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=12)
    ap.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--seed", type=int, default=4321, help="task stream (not the RL run's seed 0)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    if args.draws < 5:
        ap.error("--draws must be >= 5: the random baseline is a mean over draws")
    setup_process()

    gates = load_gates(args.gates)
    model, _, engine = reasoner(args.model)
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from kvrl.engines.vllm import VLLMEngine

        engine = VLLMEngine(resolve_path(args.model), dtype="float32", seed=0)
    env, tasks = draw_tasks("kvrl/counts-v0", args.tasks, args.seed)

    def heads(g):
        return head_allocation(g, args.sparsity, model.config, sink=args.sink, recent=args.recent)

    def run(policy):
        return evaluate(engine, env, tasks, args.max_new_tokens, batch_size=args.batch_size, policy=policy)["acc"]

    def compressed(alloc):
        return [[int(l), int(h)] for l, h in alloc.compressed_mask().nonzero().tolist()]

    rlkv, inverted = heads(gates), heads(-gates)
    gen = torch.Generator().manual_seed(args.seed)
    draws = [heads(torch.rand(gates.shape, generator=gen)) for _ in range(args.draws)]
    random_acc = [run(d) for d in draws]
    result = {
        "model": args.model,
        "engine": args.engine,
        "tasks": len(tasks),
        "sparsity": args.sparsity,
        "window": {"sink": args.sink, "recent": args.recent},
        "heads": int(gates.numel()),
        "compressed": int(rlkv.compressed_mask().sum()),
        "gates": [[round(v, 4) for v in row] for row in gates.tolist()],
        "acc_full": run(None),
        "acc_rlkv": run(rlkv),
        "acc_random_mean": float(np.mean(random_acc)),
        "acc_random_std": float(np.std(random_acc)),
        "acc_random": random_acc,
        "acc_inverted": run(inverted),
        "compressed_rlkv": compressed(rlkv),
        "compressed_inverted": compressed(inverted),
        "compressed_random": [compressed(d) for d in draws],
    }
    result["margin_vs_random"] = result["acc_rlkv"] - result["acc_random_mean"]
    result["margin_ok"] = result["margin_vs_random"] >= 0.10
    emit(result)


if __name__ == "__main__":
    main()
