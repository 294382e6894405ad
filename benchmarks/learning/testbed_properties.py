"""The task properties that KV-compression methods exploit, measured on each shipped tiny
reasoner's own attention over held-out reference traces (:mod:`kvrl.eval.properties`):
chain-of-thought length and share, long-range re-reads of the chain of thought, redundancy
(near-duplicate keys, repeated 3-grams) and whether accumulated attention predicts what
the rest of the trace reads, and (multihop) the share of the sequence an oracle must keep at
its peak (:func:`kvrl.envs.multihop.oracle_need`). Prints one JSON line: the counts and multihop reasoners side
by side.

    python benchmarks/learning/testbed_properties.py [--tasks 64]
"""

import argparse

import torch

from kvrl.bench import draw_tasks, emit, reasoner
from kvrl.envs.multihop import oracle_need
from kvrl.eval.properties import measure

REASONERS = {"counts": ("tiny", "kvrl/counts-v0"), "multihop": ("tiny-multihop", "kvrl/multihop-v0")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"benchmark": "testbed_properties", "tasks": args.tasks}
    for name, (path, env_id) in REASONERS.items():
        model, tok, _ = reasoner(path)
        _, tasks = draw_tasks(env_id, args.tasks, args.seed)
        out[name] = measure(model, tok, tasks)
    peaks = [oracle_need(t.meta) for t in tasks]  # multihop's: what an oracle must keep at its peak
    out["multihop"]["oracle_peak_share"] = round(sum(p / n for p, n in peaks) / len(peaks), 4)
    emit(out)


if __name__ == "__main__":
    main()
