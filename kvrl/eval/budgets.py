"""Accuracy under KV budgets: greedy evaluation of a model on its environment.

:func:`evaluate` decodes tasks in either engine under a KV policy or a static pattern and
scores them with the environment; :func:`window_death` is the sink+recent pattern. The
budget table job is ``kvrl/jobs/eval_budgets.py``; the benchmarks call :func:`evaluate`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from kvrl.engines.hf import HFEngine, Sampling
from kvrl.envs.base import Task
from kvrl.policies.heads import sink_recent_death

DeathFn = Callable[[list[Task], int], torch.Tensor]


def window_death(config, batch: int, T: int, sink: int, recent: int, device="cpu") -> torch.Tensor:
    """Sink+recent for every head of a model ``config`` (:func:`sink_recent_death`), [L, B, H, T]."""
    return sink_recent_death(T, sink, recent).expand(config.num_hidden_layers, batch, config.num_key_value_heads, T).to(device)


def evaluate(engine: HFEngine, env, tasks: list[Task], max_new_tokens: int, death_fn: DeathFn | None = None,
             batch_size: int = 64, desc: str = "eval", policy=None) -> dict:
    """Greedy accuracy and metrics of ``tasks`` in ``engine`` (HF or vLLM) under ``policy``
    (as ``engine.generate`` takes it), or the static pattern ``death_fn(batch, T)``."""
    texts, tokens, rewards, infos = [], [], [], []
    for i in tqdm(range(0, len(tasks), batch_size), desc=desc, leave=False):
        batch = tasks[i:i + batch_size]
        T = max(len(engine.tokenizer(t.prompt)["input_ids"]) for t in batch) + max_new_tokens + 1
        out = engine.generate([t.prompt for t in batch], Sampling(max_new_tokens), policy=policy,
                              death=None if death_fn is None else death_fn(batch, T))
        texts += out.texts
        tokens += out.tokens
        for t, text in zip(batch, out.texts):
            r, info = env.score(t, text)
            rewards.append(r)
            infos.append(info)
    prompt_len = [len(engine.tokenizer(t.prompt)["input_ids"]) for t in tasks]
    seq_len = [p + len(g) + 1 for p, g in zip(prompt_len, tokens)]  # + EOS
    return {"acc": float(np.mean(rewards)), "texts": texts, "tokens": tokens,
            "mean_seq_len": float(np.mean(seq_len)),
            "cot_fraction": float(np.mean([(s - p) / s for s, p in zip(seq_len, prompt_len)])),
            "metrics": {k: float(np.mean([i[k] for i in infos])) for k in infos[0]}}
