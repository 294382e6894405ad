"""Do the vLLM and HF engines roll out the same distribution on counts under ``tiny_gkv_sparse``'s G-KV?

The tests hold the engines equal on random models and chain prompts; this checks the recipe's own
setting, the shipped tiny reasoner on the validation stream's counts tasks under G-KV at budget 76.
Greedy: the share of tasks whose tokens, and whose eviction traces, are equal. Sampled at the recipe's
temperature (``--samples`` a task, in ``--samples`` seeded batches): each engine's mean reward with its
standard error, and the share of samples whose text differs from the greedy one; one JSON line.

    python benchmarks/learning/gkv_engines_sample.py [--tasks 64] [--samples 16]
"""

import argparse
import os

import numpy as np
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as the tests run it

from kvrl.bench import VALIDATION_SEED, draw_tasks, emit, reasoner, recipe_policy  # noqa: E402
from kvrl.config import load_config  # noqa: E402
from kvrl.engines.base import Sampling  # noqa: E402
from kvrl.engines.vllm import VLLMEngine  # noqa: E402
from kvrl.models.tiny import resolve_path  # noqa: E402
from kvrl.runlog import setup_process  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--samples", type=int, default=16, help="samples a task at the recipe's temperature")
    args = ap.parse_args()
    setup_process()
    cfg = load_config(["recipe=tiny_gkv_sparse"])
    env, tasks = draw_tasks(cfg.env.id, args.tasks, VALIDATION_SEED, **cfg.env.kwargs)
    model, _, hf = reasoner(cfg.model.path)
    engines = {"hf": hf, "vllm": VLLMEngine(resolve_path(cfg.model.path), dtype="float32", seed=cfg.seed)}
    prompts = [t.prompt for t in tasks]
    new = cfg.sampling.max_new_tokens

    def policy():  # a fresh one per call: a policy may keep per-batch state
        return recipe_policy(cfg.kv.policy, model.config, cfg.kv)

    greedy = {k: e.generate(prompts, Sampling(max_new_tokens=new), policy=policy()) for k, e in engines.items()}
    a, b = greedy["hf"], greedy["vllm"]
    line = {
        "benchmark": "gkv_engines_sample",
        "tasks": args.tasks,
        "stream_seed": VALIDATION_SEED,
        "temperature": cfg.sampling.temperature,
        "greedy_same_tokens": sum(x == y for x, y in zip(a.tokens, b.tokens)) / len(prompts),
        "greedy_same_traces": sum(torch.equal(a.trace(i).death, b.trace(i).death) for i in range(len(prompts)))
        / len(prompts),
    }
    for name, engine in engines.items():
        rewards, off = [], []
        for seed in range(args.samples):
            out = engine.generate(
                prompts, Sampling(temperature=cfg.sampling.temperature, max_new_tokens=new, seed=seed), policy=policy()
            )
            rewards += [env.score(t, text)[0] for t, text in zip(tasks, out.texts)]
            off += [text != g for text, g in zip(out.texts, a.texts)]
        line[name] = {
            "reward": round(float(np.mean(rewards)), 4),
            "se": round(float(np.std(rewards) / np.sqrt(len(rewards))), 4),
            "off_greedy": round(float(np.mean(off)), 4),
        }
    line["reward_ratio_vllm_over_hf"] = round(line["vllm"]["reward"] / line["hf"]["reward"], 4)
    emit(line)


if __name__ == "__main__":
    main()
