"""The learning signal GRPO would see on the multihop reasoner under a compressed cache:
for each reward design, the share of groups whose samples' rewards differ (a group whose
rewards are all equal has zero advantage everywhere and teaches nothing) and the mean
in-group spread.

Groups of ``--group`` samples of the same task are decoded by the HF engine under G-KV (the
RL-Sparse recipe's policy, interval, window and sink) at each budget, at each temperature, on
a validation stream of tasks (``--seed``, never the test stream the RL benchmarks judge on).
Each group is scored by every reward design of :class:`kvrl.envs.multihop.MultiHopEnv`:

* ``exact``: 1 when every query's value is right (the judged metric);
* ``partial``: exact + the share of queries right (``partial_credit=1``);
* ``segment``: each query's own answer (``rl.credit=segment``), its groups counted per query.

``errors`` says where the wrong queries went wrong, as shares of all queries: ``walk`` (the query's chain of
thought reached no conclusion ``q = v ;`` or a wrong one) or ``copy`` (its conclusion was right and the box
got its digit wrong: the answer lost the conclusion it reads back); ``copy_by_position`` is ``copy`` for the
first, second, ... query of the task. ``--models`` samples other reasoners too (``untrained``: the recipe's; a
trained run's ``model`` folder), a line each.

Prints one JSON line; ``--name`` also records it in ``benchmarks/results/<name>.json``.

    python benchmarks/learning/multihop_signal.py [--tasks 16] [--group 8] [--budgets 235 117] [--models untrained DIR]
"""

import argparse

import numpy as np

from kvrl.bench import VALIDATION_SEED, draw_tasks, emit, reasoner, record, timed
from kvrl.config import load_config
from kvrl.engines.base import Sampling
from kvrl.envs.base import correct
from kvrl.envs.multihop import conclusion_ends, queries_right, query_accuracy
from kvrl.policies import make_policy
from kvrl.runlog import setup_process

DESIGNS = {"exact": lambda t, c: correct(t, c), "partial": lambda t, c: correct(t, c) + query_accuracy(t, c)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--budgets", type=int, nargs="+", default=[235, 117])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0])
    ap.add_argument("--seed", type=int, default=VALIDATION_SEED)
    ap.add_argument("--models", nargs="+", default=["untrained"], help="untrained (the recipe's) or model folders")
    ap.add_argument("--name", default=None, help="record the line in benchmarks/results/<name>.json")
    args = ap.parse_args()
    setup_process()

    cfg = load_config(["recipe=tiny_multihop_sparse"])
    env, tasks = draw_tasks(cfg.env.id, args.tasks, args.seed)
    prompts = [t.prompt for t in tasks for _ in range(args.group)]
    # each reasoner loaded once (tiny models: all of them fit), then sampled at every budget
    engines = {m: reasoner(cfg.model.path if m == "untrained" else m)[2] for m in args.models}
    lines, cpu_total = [], 0.0
    for model, budget in [(m, b) for m in args.models for b in args.budgets]:
        engine = engines[model]
        kv = cfg.kv
        policy = make_policy(
            kv.policy,
            engine.model.config,
            budget=budget,
            interval=kv.interval,
            window=kv.window,
            sink=kv.sink,
            **kv.kwargs,
        )
        for temperature in args.temperatures:
            sampling = Sampling(cfg.sampling.max_new_tokens, temperature=temperature, seed=args.seed)
            cpu, _, out = timed(lambda: engine.generate(prompts, sampling, policy=policy))
            cpu_total += cpu
            line = {"model": model, "budget": budget, "temperature": temperature}
            for name, fn in DESIGNS.items():
                r = np.array([fn(tasks[i // args.group], text) for i, text in enumerate(out.texts)])
                groups = r.reshape(args.tasks, args.group)
                line[name] = {
                    "mean": round(float(r.mean()), 4),
                    "groups_with_signal": round(float((groups.std(1) > 0).mean()), 4),
                    "mean_group_std": round(float(groups.std(1).mean()), 4),
                }
            segments = [env.segments(tasks[i // args.group], text, text.split()) for i, text in enumerate(out.texts)]
            per_query = [
                np.array([c for _, c in segments[g * args.group : (g + 1) * args.group]]).T for g in range(args.tasks)
            ]
            spread = np.concatenate([q.std(1) for q in per_query])  # one row per (task, query): its G answers
            line["segment"] = {
                "mean": round(float(np.mean([c for _, cs in segments for c in cs])), 4),
                "groups_with_signal": round(float((spread > 0).mean()), 4),
                "mean_group_std": round(float(spread.mean()), 4),
            }
            line["errors"] = error_places([tasks[i // args.group] for i in range(len(prompts))], out.texts)
            lines.append(line)
    line = {
        "benchmark": "multihop_signal",
        "untrained": cfg.model.path,
        "policy": cfg.kv.policy,
        "tasks": args.tasks,
        "group": args.group,
        "validation_seed": args.seed,
        "lines": lines,
        "cpu_s": round(cpu_total, 1),
    }
    record(args.name, line) if args.name else emit(line)


def error_places(tasks, texts) -> dict:
    """Shares of all queries wrong in the box after a wrong walk and after a right one (a lost conclusion)."""
    walk = copy = total = 0
    by_position: dict[int, list[int]] = {}
    for task, text in zip(tasks, texts):
        words, queries = text.split(), task.meta["queries"]
        concluded = {q: words[e - 2] for q, e in zip(queries, conclusion_ends(queries, words, len(words)))}
        for i, (q, v, right) in enumerate(zip(queries, task.answer.split(), queries_right(task, text))):
            total += 1
            lost = not right and concluded.get(q) == v
            walk += not right and not lost
            copy += lost
            by_position.setdefault(i, []).append(int(lost))
    return {
        "walk": round(walk / total, 4),
        "copy": round(copy / total, 4),
        "copy_by_position": [round(float(np.mean(by_position[i])), 4) for i in sorted(by_position)],
    }


if __name__ == "__main__":
    main()
