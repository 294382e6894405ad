"""ForesightKV's loss ratio (ForesightKV, arXiv 2602.03203, Table 2) and accuracy on the tiny reasoner.

Loss ratio = Σ loss / Σ full-cache loss over the generated tokens of the held-out traces
of a ``tiny_foresight`` run (``outputs/tiny_foresight/traces/heldout``), each policy
replayed by the same chunked teacher-forced pass (``kvrl.envs.eviction.run_policy``) at
each (budget, interval): Golden Eviction (the oracle), Foresight-SFT and Foresight-RL (the
run's stage 1 / stage 2 scorers, deterministic top-k), R-KV, SnapKV, H2O, G-KV,
StreamingLLM. The scorers were trained at the run's own setting; the other setting tests
how they transfer. The tiny reasoner's greedy traces cost it ~1e-8 nats per token with the
full cache, so the ratios are huge and only their order is comparable across policies;
``excess_nats_per_token`` (compressed − full loss per generated token) gives the scale.

Accuracy: greedy decoding of fresh counts tasks with the vLLM engine (the scorer runs
inside it) under Foresight-RL, R-KV, G-KV and StreamingLLM at one budget, and Foresight-RL
in the HF reference engine for comparison. Prints one JSON line.

    python -m kvrl.run recipe=tiny_foresight          # trains the scorers (~6 min)
    python benchmarks/learning/foresight_loss_ratio.py [--run outputs/tiny_foresight]
"""

import argparse
import os
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from kvrl.algos.foresight import RULE_BASED, loss_ratios
from kvrl.bench import draw_tasks, emit, reasoner
from kvrl.data.traces import load_traces
from kvrl.engines.base import Sampling
from kvrl.models.tiny import resolve_path
from kvrl.policies import make_policy
from kvrl.runlog import setup_process

WINDOW, SINK = 8, 4


def scorer(model, path, budget, interval):
    policy = make_policy("learned", model.config, budget=budget, interval=interval, window=WINDOW, sink=SINK)
    policy.scorer.load_state_dict(load_file(path))
    return policy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="outputs/tiny_foresight", help="output_dir of a tiny_foresight run")
    ap.add_argument("--settings", default="48,16;40,8", help="(budget,interval) pairs, ';'-separated")
    ap.add_argument("--traces", type=int, default=64, help="held-out traces used")
    ap.add_argument("--accuracy-budget", default="48,16", help="(budget,interval) of the accuracy comparison")
    ap.add_argument("--tasks", type=int, default=128)
    ap.add_argument("--seed", type=int, default=4321)
    args = ap.parse_args()
    setup_process()
    run = Path(args.run)
    model, tok, hf = reasoner("tiny")
    model.requires_grad_(False)
    heldout = load_traces(run / "traces" / "heldout")[: args.traces]
    weights = {"foresight_sft": run / "sft" / "scorer.safetensors", "foresight_rl": run / "rl" / "scorer.safetensors"}

    # -- loss ratios at every setting, all policies side by side
    full_per_token = sum(map(sum, (t.loss for t in heldout))) / sum(len(t.loss) for t in heldout)
    ratios, excess = {}, {}
    for setting in args.settings.split(";"):
        budget, interval = map(int, setting.split(","))
        policies = {
            "golden": "golden",
            **{k: scorer(model, p, budget, interval) for k, p in weights.items()},
            **{n: n for n in RULE_BASED},
        }
        r = loss_ratios(model, heldout, policies, budget=budget, interval=interval, window=WINDOW, sink=SINK)
        # The greedy traces' full-cache loss is ~1e-8 nats per token, so a ratio's size says
        # little by itself; the loss each policy adds per token (nats) is the readable scale.
        excess[f"({budget},{interval})"] = {k: (v - 1) * full_per_token for k, v in r.items()}
        r["ordering_holds"] = bool(r["foresight_rl"] <= r["foresight_sft"] < min(r[n] for n in RULE_BASED))
        ratios[f"({budget},{interval})"] = r

    # -- accuracy under the vLLM engine (the learned scorer evicts inside vLLM)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvrl.engines.vllm import VLLMEngine

    budget, interval = map(int, args.accuracy_budget.split(","))
    engine = VLLMEngine(resolve_path("tiny"), tok, max_model_len=512)
    env, tasks = draw_tasks("kvrl/counts-v0", args.tasks, args.seed)
    accuracy = {}
    kv = dict(budget=budget, interval=interval, window=WINDOW, sink=SINK)
    policies = {
        "full": None,
        "foresight_rl": scorer(model, weights["foresight_rl"], budget, interval),
        **{n: make_policy(n, model.config, **kv) for n in ("rkv", "gkv", "streaming")},
    }
    for name, policy in policies.items():
        out = engine.generate([t.prompt for t in tasks], Sampling(max_new_tokens=64), policy=policy)
        accuracy[name] = float(np.mean([env.score(t, text)[0] for t, text in zip(tasks, out.texts)]))
    # the same scorer in the HF reference engine: the two engines should agree
    policy = scorer(model, weights["foresight_rl"], budget, interval)
    texts = [
        text
        for i in range(0, len(tasks), 64)
        for text in hf.generate([t.prompt for t in tasks[i : i + 64]], Sampling(max_new_tokens=64), policy=policy).texts
    ]
    accuracy["foresight_rl_hf_engine"] = float(np.mean([env.score(t, text)[0] for t, text in zip(tasks, texts)]))
    emit(
        {
            "run": str(run),
            "heldout_traces": len(heldout),
            "mean_trace_tokens": float(np.mean([len(t.ids) for t in heldout])),
            "full_cache_loss_per_token": full_per_token,
            "window": WINDOW,
            "sink": SINK,
            "loss_ratio": ratios,
            "excess_nats_per_token": excess,
            "accuracy": {"engine": "vllm", "budget": budget, "interval": interval, "tasks": len(tasks), **accuracy},
        }
    )


if __name__ == "__main__":
    main()
