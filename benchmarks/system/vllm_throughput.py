"""kvrl's vLLM engine: what compressed decoding buys, measured side by side in one run.

The model is built here from a config (random weights; EOS ignored, so every request decodes exactly
``--new`` tokens): Llama, 8 layers, hidden 512, 8 query / 2 KV heads of size 64, float32 — 8 KiB of KV
per token, so at the mean context the KV read per decode step exceeds the weight read, as for the seed
models at reasoning lengths. One torch thread. Four settings, one JSON line each:

``equal``  the same batch (``--batch``, default 16) with the full cache and with each policy,
    interleaved over ``--repeats`` rounds; each figure paired within a round, reported as mean, min and
    max over the rounds (a best-of does not reproduce on a shared machine). ``ratio`` = compressed/full
    tokens per CPU-second of the process (CPU time moves less with the machine's load than wall time;
    ``ratio_wall``: in wall time); ``predicted`` = the full cache's own CPU time with each decode step at
    the compressed mean context (its per-step CPU times fitted linearly against context length);
    ``achieved_over_predicted`` = ratio / predicted; ``evict_share`` = eviction / decode seconds.
``fixed``  the papers' setting: KV blocks for ``--full-requests`` full-length requests, ``--requests``
    submitted: total tokens/s and peak running requests, full vs each policy (``preemptions``: none).
``calls``  at each of ``--concurrency``: microseconds per eviction call (one or, with fewer than 16
    requests due, several layers), ``requests_per_call``, microseconds per request and layer (split by
    phase in ``us_per_request_by_phase``: reading the caches, ``score``, ``select``, compaction, the
    rest) and the eviction share of decode. ``floor_us_per_request`` times only the matmuls and softmax
    the policy's score cannot avoid (:func:`floor_us_per_request`), ``floor_share`` the share that alone
    costs; with StreamingLLM in the run (it scores nothing), ``bound_share`` = its share plus a policy's
    floor share, the least that policy's eviction can cost here. Below 16 concurrent requests
    (``evicting.EVICT_ROWS``) ``speedup_over_one_layer_per_call`` compares with one layer per call.
``bookkeeping``  what token mode costs besides eviction: the full cache against StreamingLLM at a
    budget above every sequence (it never evicts, but plans, remaps, writes positions and keeps the
    query ring), interleaved, best of ``--repeats``; ``overhead`` = 1 − full/no-eviction wall time
    (``cpu_s``: each one's least CPU seconds). ``equal``'s achieved/predicted cannot exceed
    1 − overhead − the eviction share.

    python benchmarks/system/vllm_throughput.py equal --batch 16
    python benchmarks/system/vllm_throughput.py fixed
    python benchmarks/system/vllm_throughput.py calls --concurrency 1,16,64
    python benchmarks/system/vllm_throughput.py bookkeeping --batch 64 --new 256 --repeats 3 --policies streaming

Policies: ``streaming``, ``h2o``, ``snapkv``, ``rkv``, ``gkv`` at ``--budget``/``--interval`` (sink 4,
window 16), ``heads`` (RLKV head reallocation at sparsity 0.5, sink 4 + recent 64, random gates) and
``mixed`` (RLKV's mixed gates, uniform random, sink 4 + recent 64).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvrl.bench import emit, interleaved, spread, timed  # noqa: E402
from kvrl.engines.base import Sampling  # noqa: E402
from kvrl.engines.vllm.evicting import cache_len_after  # noqa: E402
from kvrl.policies import RULE_BASED, HeadAllocation, Mixed, make_policy  # noqa: E402

TOKEN_POLICIES = RULE_BASED  # the zoo's, less the learned scorer (which needs a trained artefact)
BLOCK = 32


def build_model(path: str) -> str:
    """The 20M-parameter benchmark model (see the module docstring), saved to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=512,
        intermediate_size=1280,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def prompts(n: int, seed: int = 0) -> list[str]:
    """Prompts of 60-100 tokens (word-level tokenizer: one word, one token)."""
    from kvrl.models.tiny import VOCAB

    rng = np.random.default_rng(seed)
    words = [w for w in VOCAB if w.isalpha()]
    return [" ".join(rng.choice(words, size=int(rng.integers(60, 100)))) for _ in range(n)]


def make(name: str, args, layers: int, kv_heads: int):
    if name == "full":
        return None
    if name == "heads":
        gates = torch.rand(layers, kv_heads, generator=torch.Generator().manual_seed(0))
        return HeadAllocation(gates=gates, sparsity=0.5, layers=layers, kv_heads=kv_heads, sink=4, recent=64)
    if name == "mixed":
        return Mixed(torch.rand(layers, kv_heads, generator=torch.Generator().manual_seed(0)), sink=4, recent=64)
    return make_policy(name, budget=args.budget, interval=args.interval, window=16, sink=4)


class StepTimer:
    """Wraps the engine's ``step``: the process's CPU time of every step (one thread: the
    engine's), and peak running requests."""

    def __init__(self, engine):
        self.llm_engine = engine.llm.llm_engine
        self.step = self.llm_engine.step
        self.sched = self.llm_engine.engine_core.engine_core.scheduler
        self.times: list[float] = []
        self.peak = self.preemptions = 0

    def __enter__(self):
        def timed():
            start = time.process_time()
            out = self.step()
            self.times.append(time.process_time() - start)
            self.peak = max(self.peak, len(self.sched.running))
            self.preemptions = max(self.preemptions, sum(r.num_preemptions for r in self.sched.running))
            return out

        self.llm_engine.step = timed
        return self

    def __exit__(self, *exc):
        self.llm_engine.step = self.step


def run(engine, batch, sampling, policy):
    """(tokens, per-step times, output, peak running, preemptions); the callers time it."""
    with StepTimer(engine) as timer:
        out = engine.generate(batch, sampling, policy=policy)
    return sum(len(t) for t in out.tokens), np.asarray(timer.times), out, timer.peak, timer.preemptions


def context_lengths(prompt_lens, new: int, policy) -> np.ndarray:
    """Mean entries each decode step's attention reads, per step (the kernel's length)."""
    steps = []
    for g in range(1, new):  # the forward that writes generated token g (its input)
        lens = [p + g if policy is None else cache_len_after(p + g - 1, p, policy) + 1 for p in prompt_lens]
        steps.append(np.mean(lens))
    return np.asarray(steps)


def equal(args, engine, layers, kv_heads):
    batch = prompts(args.batch)
    sampling = Sampling(max_new_tokens=args.new, ignore_eos=True)
    names = args.policies.split(",")
    runs = interleaved(
        {
            name: lambda name=name: run(engine, batch, sampling, make(name, args, layers, kv_heads))
            for name in ["full", *names]
        },
        args.repeats,
    )
    full = runs["full"]
    plens = [len(p) for p in full.outs[0][2].prompt_ids]
    ctx_full = context_lengths(plens, args.new, None)
    fits = []  # per round: decode steps only (the first steps also prefill): step CPU = a + b · mean context
    for _, times, _, _, _ in full.outs:
        fits.append(np.polyfit(ctx_full, times[-len(ctx_full) :], 1))
    result = {
        "setting": "equal",
        "batch": args.batch,
        "new_tokens": args.new,
        "budget": args.budget,
        "interval": args.interval,
        "repeats": args.repeats,
        "full_tokens_per_cpu_s": spread([o[0] / c for o, c in zip(full.outs, full.cpu_s)], 1),
        "step_fit_ms": {
            "a": spread([1e3 * a for _, a in fits], 3),
            "b_per_1k_tokens": spread([1e6 * b for b, _ in fits], 3),
        },
        "policies": {},
    }
    for name in names:
        r, policy = runs[name], make(name, args, layers, kv_heads)
        rounds = {"ratio": [], "ratio_wall": [], "evict_share": [], "predicted": [], "achieved_over_predicted": []}
        for i, (tok, _, out, _, _) in enumerate(r.outs):
            tokens = full.outs[i][0]
            rounds["ratio"].append((tok / r.cpu_s[i]) / (tokens / full.cpu_s[i]))
            rounds["ratio_wall"].append((tok / r.wall_s[i]) / (tokens / full.wall_s[i]))
            rounds["evict_share"].append(out.timing["evict"] / out.timing["decode"])
            if name in TOKEN_POLICIES:
                saved = fits[i][0] * (ctx_full - context_lengths(plens, args.new, policy)).sum()
                rounds["predicted"].append(full.cpu_s[i] / (full.cpu_s[i] - saved))
                rounds["achieved_over_predicted"].append(rounds["ratio"][-1] / rounds["predicted"][-1])
        result["policies"][name] = {key: spread(values, 3) for key, values in rounds.items() if values}
    return result


def fixed(args, engine, layers, kv_heads):
    batch = prompts(args.requests, seed=1)
    sampling = Sampling(max_new_tokens=args.new, ignore_eos=True)
    result = {
        "setting": "fixed",
        "kv_blocks": engine.num_blocks,
        "block_size": engine.block_size,
        "requests": args.requests,
        "new_tokens": args.new,
        "budget": args.budget,
        "policies": {},
    }
    admission = engine.admission
    engine.admission = "always"  # the full cache too: admitted only while its peak blocks fit
    try:
        for name in ["full", *args.policies.split(",")]:
            cpu, wall, (tok, _, _, peak, pre) = timed(
                lambda: run(engine, batch, sampling, make(name, args, layers, kv_heads))
            )
            result["policies"][name] = {
                "tokens_per_s": round(tok / wall, 1),
                "peak_running": peak,
                "preemptions": pre,
                "cpu_s": round(cpu, 1),
            }
    finally:
        engine.admission = admission
    full = result["policies"]["full"]
    for row in result["policies"].values():
        row["throughput_vs_full"] = round(row["tokens_per_s"] / full["tokens_per_s"], 3)
        row["concurrency_vs_full"] = round(row["peak_running"] / full["peak_running"], 3)
    return result


def bookkeeping(args, engine, layers, kv_heads):
    batch = prompts(args.batch)
    sampling = Sampling(max_new_tokens=args.new, ignore_eos=True)
    never = make_policy("streaming", budget=2 * (100 + args.new), interval=args.interval, window=16, sink=4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="kv budget")  # "will never evict": the point here
        runs = interleaved(
            {
                name: lambda policy=policy: run(engine, batch, sampling, policy)[0]
                for name, policy in (("full", None), ("no_evictions", never))
            },
            args.repeats,
        )
    best = {name: min(r.wall_s) for name, r in runs.items()}
    return {
        "setting": "bookkeeping",
        "batch": args.batch,
        "new_tokens": args.new,
        "repeats": args.repeats,
        "wall_s": {k: round(v, 2) for k, v in best.items()},
        "cpu_s": {k: round(min(r.cpu_s), 2) for k, r in runs.items()},
        "overhead": round(1 - best["full"] / best["no_evictions"], 4),
    }


def timing(owner, attr: str, spent: dict):
    """Replace ``owner.attr`` with a version that adds its wall seconds to ``spent[attr]``;
    returns what restores it."""
    original, own = getattr(owner, attr), attr in vars(owner)

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent[attr] += time.perf_counter() - start

    setattr(owner, attr, timed)
    return (lambda: setattr(owner, attr, original)) if own else (lambda: delattr(owner, attr))


# What a policy's score cannot do without at an eviction: the observation window's logits
# over the cache and their softmax; R-KV and G-KV also the cosines of the interval's new
# keys with the cache (their incremental redundancy).
FLOOR_OPS = {"h2o": False, "snapkv": False, "rkv": True, "gkv": True}


def floor_us_per_request(shape, kv_heads: int, interval: int, *, redundancy: bool) -> float:
    """Microseconds per request and layer of the floor ops alone (torch's own matmul and
    softmax, no masks, pooling, gathers or state) at a score call's shape (rows, Hq, W, N, D),
    the keys in the engine's transposed layout; the best of 15 timings of 10 calls (the
    least disturbed by the machine's other load)."""
    rows, hq, w, n, d = shape
    b = rows * kv_heads
    q = torch.randn(b, hq // kv_heads * w, d)
    k_t = torch.randn(b, d, n)
    new = torch.randn(b, interval, d)

    def ops():
        (q @ k_t).softmax(-1)
        if redundancy:
            new @ k_t

    def ten():
        for _ in range(10):
            ops()

    ops()
    return 1e6 * min(interleaved({"ten": ten}, 15)["ten"].wall_s) / 10 / rows


def calls(args, engine, layers, kv_heads):
    from kvrl.engines.vllm import evicting
    from kvrl.engines.vllm.cpu_backend import CPULayout
    from kvrl.engines.vllm.evicting import EvictingWorker

    sampling = Sampling(max_new_tokens=args.new, ignore_eos=True)
    result = {
        "setting": "calls",
        "new_tokens": args.new,
        "budget": args.budget,
        "interval": args.interval,
        "policies": {},
    }
    evict, rows_per_call = EvictingWorker._evict, evicting.EVICT_ROWS
    for name in args.policies.split(","):
        rows = {}
        for n in [int(c) for c in args.concurrency.split(",")]:
            spent = {"calls": 0, "rows": 0, "seconds": 0.0, "read": 0.0, "score": 0.0, "select": 0.0, "compact": 0.0}

            def timed(worker, batch, evicted, spent=spent):
                start = time.perf_counter()
                evict(worker, batch, evicted)
                spent["calls"] += 1
                spent["rows"] += len(batch.rows) * len(evicted)
                spent["seconds"] += time.perf_counter() - start

            policy = make(name, args, layers, kv_heads)
            phases = [(CPULayout, "read"), (CPULayout, "compact"), (type(policy), "score"), (type(policy), "select")]
            restores = [timing(owner, attr, spent) for owner, attr in phases]
            shapes = []  # (rows, Hq, W, N, D) of every score call, for the floor
            score = type(policy).score

            def shaped(self, obs, score=score, shapes=shapes):
                if obs.queries is not None and obs.keys is not None:  # StreamingLLM reads neither
                    shapes.append((*obs.queries.shape[:3], *obs.keys.shape[2:]))
                return score(self, obs)

            type(policy).score = shaped
            EvictingWorker._evict = timed
            try:
                out = run(engine, prompts(n, seed=2), sampling, policy)[2]
            finally:
                EvictingWorker._evict = evict
                type(policy).score = score
                for restore in restores:
                    restore()
            if not spent["rows"]:
                raise SystemExit(
                    f"calls: {name} never evicted at {n} requests: the sequences (~100-token prompts + "
                    f"--new {args.new}) stay within --budget {args.budget}; raise --new or lower --budget"
                )
            calls_ = spent["calls"]
            rows[n] = {
                "us_per_call": round(1e6 * spent["seconds"] / calls_, 1),
                "requests_per_call": round(spent["rows"] / calls_, 1),
                "us_per_request": round(1e6 * spent["seconds"] / spent["rows"], 1),
                "evict_share": round(spent["seconds"] / out.timing["decode"], 4),
            }
            per_row = 1e6 / spent["rows"]
            by_phase = {k: round(per_row * spent[k], 1) for k in ("read", "score", "select", "compact")}
            by_phase["other"] = round(rows[n]["us_per_request"] - sum(by_phase.values()), 1)
            rows[n]["us_per_request_by_phase"] = by_phase
            if name in FLOOR_OPS and shapes:
                floor = floor_us_per_request(
                    max(set(shapes), key=shapes.count), kv_heads, args.interval, redundancy=FLOOR_OPS[name]
                )
                rows[n]["floor_us_per_request"] = round(floor, 1)
                rows[n]["floor_share"] = round(rows[n]["evict_share"] * floor / rows[n]["us_per_request"], 4)
            if n < evicting.EVICT_ROWS:  # calls may take several layers: the same run at one layer per call
                spent = {"calls": 0, "rows": 0, "seconds": 0.0}
                # a method: partial objects do not bind the worker
                EvictingWorker._evict = lambda worker, batch, evicted, spent=spent: timed(worker, batch, evicted, spent)
                evicting.EVICT_ROWS = 1
                try:
                    out = run(engine, prompts(n, seed=2), sampling, policy)[2]
                finally:
                    EvictingWorker._evict, evicting.EVICT_ROWS = evict, rows_per_call
                one = 1e6 * spent["seconds"] / max(1, spent["rows"])
                rows[n]["one_layer_per_call"] = {
                    "us_per_request": round(one, 1),
                    "evict_share": round(spent["seconds"] / out.timing["decode"], 4),
                }
                rows[n]["speedup_over_one_layer_per_call"] = round(one / rows[n]["us_per_request"], 3)
        result["policies"][name] = rows
    streaming = result["policies"].get("streaming", {})
    for rows in result["policies"].values():
        for n, row in rows.items():
            if "floor_share" in row and n in streaming:
                row["bound_share"] = round(streaming[n]["evict_share"] + row["floor_share"], 4)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("setting", choices=["equal", "fixed", "calls", "bookkeeping"])
    ap.add_argument("--model", help="a model folder (default: build the benchmark model in a temporary folder)")
    ap.add_argument("--policies", default=",".join(TOKEN_POLICIES) + ",heads")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--interval", type=int, default=32)
    ap.add_argument("--new", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--full-requests", type=int, default=8, help="fixed: KV memory for this many full-length requests")
    ap.add_argument("--requests", type=int, default=64, help="fixed: requests submitted")
    ap.add_argument("--concurrency", default="1,16,64")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoConfig

    from kvrl.engines.vllm import VLLMEngine

    path = args.model or build_model(tempfile.mkdtemp(prefix="kvrl_bench_"))
    cfg = AutoConfig.from_pretrained(path)
    longest = 100 + args.new
    blocks = None
    if args.setting == "fixed":
        blocks = args.full_requests * -(-longest // BLOCK) + 1  # + vLLM's null block
    engine = VLLMEngine(
        path, max_model_len=longest + 1, block_size=BLOCK, num_gpu_blocks_override=blocks, kv_cache_gib=4
    )
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    warm = Sampling(max_new_tokens=40, ignore_eos=True)
    for name in ["full", *args.policies.split(",")]:  # warm-up: first calls compile and allocate
        engine.generate(prompts(2), warm, policy=make(name, args, layers, kv_heads))
    setting = {"equal": equal, "fixed": fixed, "calls": calls, "bookkeeping": bookkeeping}[args.setting]
    emit(
        {
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "threads": 1,
            **setting(args, engine, layers, kv_heads),
        }
    )


if __name__ == "__main__":
    main()
