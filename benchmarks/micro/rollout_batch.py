"""The reference engine's rollout CPU at the RL recipes' sampling, by decoding batch size.

TRL's GRPOTrainer decodes a step's samples in one batch; ``tiny_rl_full`` decodes each rollout
worker's shard of 64 in one batch (``sampling.batch_size: 64``). This decodes the same 64 counts prompts (seed 0, 64 new tokens at temperature 2.5, one torch
thread) in chunks of each ``--sizes`` value, interleaved
over ``--repeats``, and reports CPU seconds per 64 samples (mean and spread) and each size's
ratio to the first.

    python benchmarks/micro/rollout_batch.py [--sizes 32,64,16] [--repeats 2]
"""

import argparse

from kvrl.bench import draw_tasks, emit, interleaved, reasoner
from kvrl.engines.base import Sampling
from kvrl.runlog import setup_process

SAMPLES = 64  # a rollout worker's shard in tiny_rl_full (16 tasks x 8 samples over 2 workers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="32,64,16")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    setup_process()
    _, _, engine = reasoner("tiny")
    _, tasks = draw_tasks("kvrl/counts-v0", SAMPLES, 0, n_digits=24)
    prompts = [t.prompt for t in tasks]
    sampling = Sampling(max_new_tokens=64, temperature=2.5, seed=0)
    engine.generate(prompts[:8], sampling)  # warm-up

    def decode(size):
        return lambda: [engine.generate(prompts[lo : lo + size], sampling) and None for lo in range(0, SAMPLES, size)]

    sizes = [int(s) for s in args.sizes.split(",")]
    runs = interleaved({str(s): decode(s) for s in sizes}, args.repeats)
    first = sum(runs[str(sizes[0])].cpu_s)
    emit(
        {
            "benchmark": "rollout_batch",
            "samples": SAMPLES,
            "repeats": args.repeats,
            "cpu_s": {k: r.summary()["cpu_s"] for k, r in runs.items()},
            "cpu_ratio_to_first": {k: round(sum(r.cpu_s) / first, 3) for k, r in runs.items()},
        }
    )


if __name__ == "__main__":
    main()
