"""What the learner's step costs on the multihop reasoner under G-KV, against the same step with the full cache.

The multihop runs logged a learner step of ~23 s under G-KV (RL-Sparse, Distill at 235) against ~11 s
for RL-Full, for about the same tokens (~43 K a step). This measures the learner's own work side by side,
on one batch: ``--tasks`` x ``--group`` samples the shipped multihop reasoner rolled out under
``tiny_multihop_sparse``'s G-KV cache (HF engine, temperature 1, its training stream; RL-Sparse's own
rollout code), scored and
backpropagated by RL-Sparse's loss (``engine.score`` replaying the batch's eviction traces) and by
RL-Full's loss on the same samples (no trace: every key visible). Both go through the same
``"kvrl_replay"`` attention, the full cache as death times that never come, so a difference is the
trace's, not the path's. The two take turns (``--repeats`` each); then one G-KV step under
``torch.profiler``, its operators' shares of the self CPU time.

Prints one JSON line: each loss's median wall and CPU seconds, their ratio, the batch's tokens, and
the profile's top operators.

    python benchmarks/system/learner_split.py [--tasks 8] [--group 8] [--repeats 3]
"""

import argparse
import statistics
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from kvrl.algos.base import collate
from kvrl.algos.grpo import group_advantages
from kvrl.algos.rl_full import RLFull
from kvrl.algos.rl_sparse import RLSparse
from kvrl.bench import draw_tasks, emit, interleaved, reasoner
from kvrl.config import load_config
from kvrl.runlog import setup_process


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    setup_process()
    cfg = load_config(["recipe=tiny_multihop_sparse"])
    _, _, engine = reasoner(cfg.model.path)
    sparse, full = RLSparse(cfg), RLFull(load_config(["recipe=tiny_multihop_full"]))
    for algo in (sparse, full):
        algo.setup(engine.model, engine.tokenizer)

    # ---- one batch, rolled out under G-KV as a rollout worker rolls it out
    env, tasks = draw_tasks(cfg.env.id, args.tasks, cfg.seed, **cfg.env.kwargs)
    grouped = [t for t in tasks for _ in range(args.group)]
    regime = sparse.rollout_policy(engine.model)
    samples, _ = sparse.generate(engine, regime, env, [str(b) for b in range(len(grouped))], grouped, cfg.seed, 0)
    adv = group_advantages(torch.tensor([s.reward for s in samples]), args.group)
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    tokens = sum(len(s.tokens) for s in samples)
    batch = collate(samples, tokens, engine.device)
    no_trace = replace(batch, trace=None)

    def step(algo, b):
        def run():
            engine.model.zero_grad(set_to_none=True)
            loss, _, _ = algo.loss(engine, b)
            loss.backward()

        return run

    # ---- side by side
    runs = interleaved({"gkv": step(sparse, batch), "full": step(full, no_trace)}, args.repeats)
    wall = {k: statistics.median(r.wall_s) for k, r in runs.items()}
    cpu = {k: statistics.median(r.cpu_s) for k, r in runs.items()}

    # ---- where a G-KV step's time goes
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(sparse, batch)()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    emit(
        {
            "benchmark": "learner_split",
            "model": cfg.model.path,
            "kv": {"policy": cfg.kv.policy, "budget": cfg.kv.budget, "interval": cfg.kv.interval},
            "samples": len(samples),
            "sequence_tokens": sum(len(s) for s in batch.sequences),
            "generated_tokens": tokens,
            "kv_retention": round(float(batch.trace.retention().mean()), 4),
            "threads": torch.get_num_threads(),
            "wall_s": {k: round(v, 3) for k, v in wall.items()},
            "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
            "gkv_over_full_wall": round(wall["gkv"] / wall["full"], 3),
            "gkv_over_full_cpu": round(cpu["gkv"] / cpu["full"], 3),
            "runs": {k: {"wall_s": r.wall_s, "cpu_s": r.cpu_s} for k, r in runs.items()},
            "profile_top_self_cpu": [
                {"op": e.key, "share": round(e.self_cpu_time_total / total, 4), "calls": e.count} for e in ops[:10]
            ],
        }
    )


if __name__ == "__main__":
    main()
