"""Accuracy under KV budgets: greedy evaluation of a model on its environment.

:func:`evaluate` decodes tasks in either engine under a cache regime (a KV policy, a static
pattern such as :class:`kvrl.policies.Window` — sink+recent on every head — or RLKV's
head allocation) and scores them with the environment. The budget table job is
``kvrl/jobs/eval.py`` (the suite); the benchmarks call :func:`evaluate`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from kvrl.engines.base import Sampling
from kvrl.engines.hf import HFEngine
from kvrl.envs.base import Task

PolicyFn = Callable[[list[Task], int], object]


def evaluate(
    engine: HFEngine,
    env,
    tasks: list[Task],
    max_new_tokens: int,
    policy_fn: PolicyFn | None = None,
    batch_size: int = 64,
    desc: str = "eval",
    policy=None,
) -> dict:
    """Greedy accuracy and metrics of ``tasks`` in ``engine`` (HF or vLLM) under ``policy``
    (a cache regime, or anything ``engine.generate`` takes), or under ``policy_fn(batch, T)``
    for a regime that depends on the batch (e.g. a ``Static`` death tensor covering T
    positions)."""
    texts, tokens, rewards, infos = [], [], [], []
    for i in tqdm(range(0, len(tasks), batch_size), desc=desc, leave=False):
        batch = tasks[i : i + batch_size]
        T = max(len(ids) for ids in engine.encode([t.prompt for t in batch])) + max_new_tokens
        out = engine.generate(
            [t.prompt for t in batch],
            Sampling(max_new_tokens),
            policy=policy if policy_fn is None else policy_fn(batch, T),
        )
        texts += out.texts
        tokens += out.tokens
        for t, text in zip(batch, out.texts):
            r, info = env.score(t, text)
            rewards.append(r)
            infos.append(info)
    prompt_len = [len(ids) for ids in engine.encode([t.prompt for t in tasks])]
    seq_len = [p + len(g) for p, g in zip(prompt_len, tokens)]  # a stopped sample ends with its stop token
    return {
        "acc": float(np.mean(rewards)),
        "rewards": rewards,
        "texts": texts,
        "tokens": tokens,
        "mean_seq_len": float(np.mean(seq_len)),
        "cot_fraction": float(np.mean([(s - p) / s for s, p in zip(seq_len, prompt_len)])),
        "metrics": {k: float(np.mean([i[k] for i in infos])) for k in infos[0]},
    }
