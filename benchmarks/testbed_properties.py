"""The task properties that KV-compression methods exploit, measured on each shipped tiny
reasoner's own attention over held-out reference traces (:mod:`kvrl.eval.properties`):
chain-of-thought length and share, long-range re-reads of the chain of thought, redundancy
(near-duplicate keys, repeated 3-grams) and whether accumulated attention predicts what
the rest of the trace reads. Prints one JSON line: the counts and multihop reasoners side
by side.

    python benchmarks/testbed_properties.py [--tasks 64]
"""

import argparse
import json

import torch

from kvrl.envs import make
from kvrl.eval.properties import measure
from kvrl.models.tiny import load_model

REASONERS = {"counts": ("tiny", "kvrl/counts-v0"), "multihop": ("tiny-multihop", "kvrl/multihop-v0")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"benchmark": "testbed_properties", "tasks": args.tasks}
    for name, (path, env_id) in REASONERS.items():
        model, tok = load_model(path)
        env = make(env_id)
        env.reset(seed=args.seed)
        out[name] = measure(model, tok, env.tasks(args.tasks))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
