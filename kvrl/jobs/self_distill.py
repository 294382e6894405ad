"""job=self_distill: RLKV's training set, the tasks the model already solves, by output length.

    python -m kvrl.run recipe=tiny_self_distill

RLKV (arXiv 2510.08525, §3.3 and Appendix B) trains its gates on problems the base model solves,
so rewards stay dense while the gates close. The candidates (``self_distill.source``) are
decoded greedily with the full cache on ``workers.engine``; the solved ones (reward > 0,
finished by a stop id) are bucketed by output length and ``self_distill.counts[b]`` drawn per
bucket (:func:`kvrl.data.self_distill.select`). Writes ``output_dir/tasks.jsonl``, which
:class:`kvrl.data.self_distill.SelfDistilledEnv` reads as an RL recipe's environment, and
``output_dir/summary.json``.
"""

from __future__ import annotations

import json

from tqdm import tqdm

from kvrl.data.self_distill import select
from kvrl.engines import make_engine
from kvrl.engines.base import Sampling
from kvrl.envs import make
from kvrl.runlog import atomic, setup_process, write_json


def main(cfg) -> dict:
    setup_process(threads=None)
    sd = cfg.self_distill

    # ---- candidates: the first self_distill.candidates tasks of the source
    env = make(sd.source, **sd.source_kwargs)
    env.reset(seed=cfg.seed)
    n = sd.candidates if env.num_tasks is None else min(sd.candidates, env.num_tasks)
    tasks = env.tasks(n)

    # ---- greedy full-cache decoding; keep what the model solves
    engine = make_engine(cfg)
    greedy = Sampling(max_new_tokens=cfg.sampling.max_new_tokens, temperature=0.0, seed=cfg.seed)
    solved, bar = [], tqdm(total=n, desc="self-distillation sampling", unit="task")
    for lo in range(0, n, cfg.sampling.batch_size):
        batch = tasks[lo : lo + cfg.sampling.batch_size]
        out = engine.generate([t.prompt for t in batch], greedy)
        for t, text, toks, why in zip(batch, out.texts, out.tokens, out.finish_reasons):
            reward, _ = env.score(t, text)
            if reward > 0 and why == "stop":
                solved.append(
                    {"id": t.id, "prompt": t.prompt, "answer": t.answer, "meta": t.meta, "output_len": len(toks)}
                )
        bar.update(len(batch))
        bar.set_postfix(solved=f"{len(solved) / min(lo + len(batch), n):.0%}")
    bar.close()

    # ---- draw per length bucket; write the set atomically (a crash leaves no half dataset)
    kept, report = select(solved, list(sd.edges), list(sd.counts), cfg.seed)
    with atomic(f"{cfg.output_dir}/tasks.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    summary = {"source": sd.source, "candidates": n, "solved": len(solved), "kept": len(kept), "buckets": report}
    write_json(f"{cfg.output_dir}/summary.json", summary)
    for r in report:
        short = f"  (only {r['kept']} solved: short by {r['wanted'] - r['kept']})" if r["kept"] < r["wanted"] else ""
        print(f"bucket {r['tokens'][0]}-{r['tokens'][1]} tokens: {r['solved']} solved, kept {r['kept']}{short}")
    print(f"{len(kept)} of {n} tasks -> {cfg.output_dir}/tasks.jsonl")
    return summary
