"""What eviction costs in the reference engine, for every policy on the tiny reasoner.

Prints one JSON line, all measured side by side in this run (greedy, CPU by default):

  evict_fraction   per policy: time spent scoring, selecting and compacting, as a fraction
                   of the whole decode loop, on the tiny reasoner's tasks (budget = half
                   the mean full-cache sequence, interval 16, window 8, sink 4)
  long_context     decode-step time at a long context (``--context`` tokens, default the
                   model's positions less the new tokens and a prompt's length: ~900 on the
                   tiny reasoner's 1,024; prompts built by repeating
                   tasks, batch 4, 64 new tokens, EOS ignored): full cache vs each policy
                   at budget 256; ``ratio`` = compressed / full (< 1: eviction pays off).
                   A step's time is (t(1 + n steps) − t(1 step)) / n, so the prefill and
                   the eviction right after it are excluded and later evictions amortised;
                   wall time (``step_ms``, ``ratio``) and CPU time (``step_cpu_ms``).

The tiny model is latency-bound (per-layer Python overhead dominates a 0.8 M-parameter
forward), so ratios here say little about large models; they are the reference numbers
the vLLM plugin and Triton kernels are compared with.

    python benchmarks/micro/policy_overhead.py [--tasks 32] [--context N] [--model tiny]
"""

import argparse

import numpy as np
import torch

from kvrl.bench import draw_tasks, emit, interleaved, reasoner
from kvrl.engines.base import Sampling
from kvrl.policies import POLICIES, make_policy

INTERVAL, WINDOW, SINK = 16, 8, 4


def policy(name, model, budget):
    return make_policy(name, model.config, budget=budget, interval=INTERVAL, window=WINDOW, sink=SINK)


def step_time(engine, prompts, kv_policy, steps, repeats) -> tuple[float, float]:
    """(wall, CPU) seconds per decode step after the prefill: (best long run - best 1-step
    run) / steps. Minimising each run separately, not their difference: the 1-step run holds
    the prefill and its eviction (R-KV's N x N similarity over 2k tokens), whose noise made
    per-repeat differences negative on a shared machine."""

    def run(n):
        engine.generate(prompts, Sampling(max_new_tokens=n, ignore_eos=True), policy=kv_policy)

    runs = interleaved({"long": lambda: run(steps + 1), "short": lambda: run(1)}, repeats)
    long, short = runs["long"], runs["short"]
    return (min(long.wall_s) - min(short.wall_s)) / steps, (min(long.cpu_s) - min(short.cpu_s)) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--model", default="tiny")
    ap.add_argument(
        "--context",
        type=int,
        default=0,
        help="prompt tokens of the long-context part; 0: the most "
        "the model holds with --steps new tokens and room for one more task prompt",
    )
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=777)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok, engine = reasoner(args.model)
    _, tasks = draw_tasks("kvrl/counts-v0", args.tasks, args.seed)
    prompts = [t.prompt for t in tasks]
    positions = model.config.max_position_embeddings
    longest = max(len(ids) for ids in tok(prompts)["input_ids"])
    args.context = args.context or positions - args.steps - 1 - longest  # the last prompt may overshoot by one

    # ~context-token prompts: each row repeats the tasks' prompts, in its own order
    rng = np.random.default_rng(args.seed)
    long_prompts = []
    for _ in range(4):
        parts, n = [], 0
        while n < args.context:
            p = prompts[int(rng.integers(len(prompts)))]
            parts.append(p)
            n += len(p.split())
        long_prompts.append(" ".join(parts))
    context = max(len(ids) for ids in tok(long_prompts)["input_ids"])
    if context + args.steps + 1 > positions:
        raise SystemExit(
            f"--context {args.context}: the long prompts are {context} tokens, which with --steps "
            f"{args.steps} + 1 new tokens exceed the model's {positions} positions; pass --context "
            f"{args.context - (context + args.steps + 1 - positions)} or less (or 0, the default)"
        )

    full = engine.generate(prompts, Sampling(max_new_tokens=160))
    mean_len = float(np.mean([len(p) + len(g) + 1 for p, g in zip(full.prompt_ids, full.tokens)]))
    budget = round(mean_len / 2)
    fraction = {}
    for name in POLICIES:
        out = engine.generate(prompts, Sampling(max_new_tokens=160), policy=policy(name, model, budget))
        fraction[name] = out.timing["evict"] / out.timing["decode"]

    full_step, full_cpu = step_time(engine, long_prompts, None, args.steps, args.repeats)
    long = {"full_step_ms": 1e3 * full_step, "full_step_cpu_ms": 1e3 * full_cpu}
    for name in POLICIES:
        t, cpu = step_time(engine, long_prompts, policy(name, model, args.budget), args.steps, args.repeats)
        long[name] = {"step_ms": 1e3 * t, "ratio": t / full_step, "step_cpu_ms": 1e3 * cpu}
    emit(
        {
            "model": args.model,
            "device": str(engine.device),
            "threads": args.threads,
            "tasks": len(tasks),
            "mean_seq_len": mean_len,
            "budget": budget,
            "interval": INTERVAL,
            "window": WINDOW,
            "sink": SINK,
            "evict_fraction": fraction,
            "long_context": {
                "context": context,
                "budget": args.budget,
                "batch": len(long_prompts),
                "steps": args.steps,
                **long,
            },
        }
    )


if __name__ == "__main__":
    main()
