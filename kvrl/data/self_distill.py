"""Self-distillation sampling: RLKV's training set (built by ``kvrl/jobs/self_distill.py``).

RLKV (arXiv 2510.08525, §3.3 and Appendix B) trains its gates on problems the base model already
solves, so rewards stay dense while the gates close: every candidate is decoded greedily
with the full cache, the correct ones are bucketed by output length (a proxy for
difficulty) and a fixed number is drawn per bucket — the paper keeps 600/600/1000/800
problems with 0–2k/2–4k/4–6k/6–8k output tokens::

    python -m kvrl.run recipe=tiny_self_distill

Contract:

* candidates: the first ``self_distill.candidates`` tasks of ``self_distill.source``
  (built with ``self_distill.source_kwargs``, seeded by ``seed``; a finite dataset gives
  at most all of its tasks — ``env.*`` is the RL env that reads the result), decoded in batches of
  ``sampling.batch_size`` with ``workers.engine`` (``vllm`` or ``hf``), greedy, full cache,
  at most ``sampling.max_new_tokens`` new tokens, under a progress bar;
* kept: reward > 0 (the environment's score), finished by a stop id; bucket b holds output
  lengths in ``[edges[b], edges[b+1])``; ``counts[b]`` of them are drawn at random
  (seeded), or all when fewer were solved (the shortfall is reported, never padded);
* written: ``output_dir/tasks.jsonl`` (one task per line: id, prompt, answer, meta,
  output_len, bucket; written atomically) and ``output_dir/summary.json``;
* read back by :class:`SelfDistilledEnv`, usable as ``env.id`` of an RL recipe
  (``env.id=kvrl.data.self_distill:SelfDistilledEnv env.kwargs={path: ..., env: kvrl/counts-v0}``):
  the selected tasks with the original environment's rewards.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvrl.envs import Task, TextEnv, make
from kvrl.envs.math import JsonlTasks


def bucket_of(length: int, edges: list[int]) -> int | None:
    """Index b with edges[b] <= length < edges[b+1]; None outside every bucket."""
    b = int(np.searchsorted(edges, length, side="right")) - 1
    return b if 0 <= b < len(edges) - 1 else None


def select(solved: list[dict], edges: list[int], counts: list[int], seed: int) -> tuple[list[dict], list[dict]]:
    """Draw ``counts[b]`` of the solved rows (each with ``output_len``) per length bucket.

    Returns (the kept rows, bucket order then draw order; per-bucket figures)."""
    rng = np.random.default_rng(seed)
    by_bucket: list[list[dict]] = [[] for _ in counts]
    for row in solved:
        b = bucket_of(row["output_len"], edges)
        if b is not None:
            by_bucket[b].append(row)
    kept, report = [], []
    for b, (rows, want) in enumerate(zip(by_bucket, counts)):
        pick = rng.permutation(len(rows))[:want].tolist()
        kept += [{**rows[i], "bucket": b} for i in pick]
        report.append(
            {"bucket": b, "tokens": [edges[b], edges[b + 1]], "solved": len(rows), "wanted": want, "kept": len(pick)}
        )
    return kept, report


class SelfDistilledEnv(TextEnv):
    """The tasks of a ``tasks.jsonl`` written by job=self_distill, scored by the rewards of the
    environment they came from (``env``, built with ``env_kwargs``); shuffled per epoch."""

    def __init__(self, path: str, env: str = "kvrl/counts-v0", env_kwargs: dict | None = None):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"no self-distilled task set at {path}: run the data step first "
                "(python -m kvrl.run recipe=tiny_self_distill) or fix env.kwargs.path"
            )
        tasks = DistilledTasks(path)  # read when drawn, as a data file of kvrl/math-v0
        if not len(tasks):
            raise ValueError(f"{path} holds no tasks: no candidate was solved; raise self_distill.candidates")
        base = make(env, **(env_kwargs or {}))
        super().__init__(tasks, base.rewards)


class DistilledTasks(JsonlTasks):
    """The rows of a ``tasks.jsonl`` that job=self_distill wrote, each read when it is drawn."""

    def _task(self, row: dict, lineno: int, index: int) -> Task:
        missing = [k for k in ("id", "prompt", "answer", "meta") if k not in row]
        if missing:
            raise ValueError(
                f"{self.path}:{lineno}: no {', '.join(missing)}: not a row job=self_distill writes; "
                "rerun the data step (python -m kvrl.run recipe=tiny_self_distill)"
            )
        return Task(row["id"], row["prompt"], row["answer"], row["meta"])
