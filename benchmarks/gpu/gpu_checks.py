"""The checks the open issues ask of a GPU, in one command: one JSON line per setting.

    PYTHONPATH=. python benchmarks/gpu/gpu_checks.py                  # a CUDA machine: all three
    PYTHONPATH=. python benchmarks/gpu/gpu_checks.py --device cpu --small   # smoke run (shrunk shapes)

It imports no vLLM (GPU machines lent to the project cannot install its CUDA build): the
eviction ops are the vLLM engine's CUDA path called directly on a cache of vLLM's
FlashAttention layout. Each setting checks its own result against a reference before it
reports a time, and raises if they disagree.

``ops``     one eviction of 64 requests with 4,096-token caches, 8 KV heads (32 query
    heads), head_dim 128, bf16, per policy: ``flash_read`` of the paged cache, the policy's
    ``score`` (float32) and ``select`` over the whole batch, and the Triton ``flash_compact``
    (checked equal to its torch reference). Milliseconds per phase (median of
    ``--repeats``), the bytes each phase has to move (read: K and V of every slot, read and
    written; score: the keys; compaction: K and V of the kept slots, read and written), the
    achieved GB/s, and their ratio to the peak measured by a 1 GiB device copy and to the
    nominal peak of the device (H100 SXM 3.35 TB/s, H100 PCIe 2.0, H200 4.8). R-KV and
    G-KV are timed at a later eviction (the picks of a previous one in their state, the
    newest ``interval`` slots new; see :func:`steady_state`) and at a first one
    (``first_score_ms``).
``replay``  the HF engine with the shrunk Qwen3 model (bf16 on CUDA): sampled rollouts
    under every policy and the full cache, scored again under their recorded trace (the
    flex-attention replay, the CUDA default): max and mean |Δlogprob|. bf16 is not exact
    (float64 replay is, ``tests/test_arch_matrix.py``); the full cache's gap is the bf16
    noise floor that a policy's gap is compared with.
``flex``    forward + backward (forward only on a CPU) of a shrunk Qwen3 on one 8K and one 32K sequence under a
    synthetic G-KV-like trace (:func:`kvrl.bench.synthetic_death`): the flex-attention replay vs
    dense per-layer masks (the reference repos' training), seconds, peak memory, and the
    max |Δ| of their logits; "oom" where one does not fit.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from kvrl.bench import emit, interleaved, register_dense_masks, synthetic_death
from kvrl.cache import EvictionTrace
from kvrl.kernels import flash_compact, flash_read
from kvrl.kernels.reference import paged as reference
from kvrl.kernels.reference.replay import NEVER
from kvrl.policies import POLICIES, RULE_BASED, Full, Observation, make_policy

NOMINAL_TBS = {"H200": 4.8, "H100 PCIe": 2.0, "H100": 3.35}  # HBM bandwidth, first match of the device name


def timed(fn, repeats: int, device: torch.device) -> tuple[float, object]:
    """Median wall seconds of ``fn()`` after one warm-up call, whose result it returns (the
    timed runs keep none: a result may be gigabytes of the GPU's memory)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    out = fn()
    sync()  # each timed run ends synchronised, so the next one starts on an idle device
    runs = interleaved({"fn": lambda: (fn(), sync())[1]}, repeats)["fn"]
    return statistics.median(runs.wall_s), out


def peaks(device: torch.device) -> dict:
    """The measured copy bandwidth (GB/s: bytes read + written) and the nominal one."""
    x = torch.empty(1 << 28 if device.type == "cuda" else 1 << 24, device=device)  # 1 GiB on a GPU
    y = torch.empty_like(x)
    s, _ = timed(lambda: y.copy_(x), 5, device)
    out = {"copy_gbs": round(2 * x.numel() * 4 / s / 1e9, 1)}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        out["name"] = name
        out["nominal_gbs"] = next((tbs * 1e3 for key, tbs in NOMINAL_TBS.items() if key in name), None)
    return out


# ---------------------------------------------------------------- ops


def paged_cache(r: int, n: int, h: int, d: int, bs: int, dtype, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FlashAttention cache, logical [nb, H, bs, 2D] in its default LBNHC order, and a
    block table [R, n / bs] of shuffled blocks (block 0 unused, as vLLM's null block)."""
    nb = r * n // bs + 1
    kv = torch.randn(nb, bs, h, 2 * d, generator=gen).to(device, dtype).permute(0, 2, 1, 3)
    table = (torch.randperm(nb - 1, generator=gen) + 1)[: r * n // bs].view(r, -1).int().to(device)
    return kv, table


def observation(keys, values, policy, gen, device) -> Observation:
    """A mid-generation eviction: sorted positions over a longer history, the newest
    ``observe`` slots contiguous (the observation queries), NaN state for the newest
    ``interval`` slots (decoded since the last eviction)."""
    r, h, n, d = keys.shape
    w = policy.observe
    history = 2 * n
    old = torch.rand(r, h, history - w, generator=gen).argsort(-1)[..., : n - w].sort(-1).values
    key_pos = torch.cat([old, torch.arange(history - w, history).expand(r, h, w)], -1).to(device)
    queries = torch.randn(r, 4 * h, w, d, generator=gen).to(device, keys.dtype)
    state = None
    if policy.state_size:
        state = torch.rand(r, h, n, policy.state_size, generator=gen).to(device)
        state[:, :, -policy.interval :] = float("nan")
    return Observation(
        keys=keys,
        values=values,
        queries=queries,
        key_pos=key_pos,
        query_pos=torch.arange(history - w, history, device=device).expand(r, w),
        state=state,
        layer=0,
        scaling=d**-0.5,
    )


def steady_state(policy, obs: Observation) -> Observation:
    """R-KV's and G-KV's state as after a previous eviction of the same keys, the newest
    ``interval`` slots without state. Every old pick is then still in the cache, so the
    need columns are the new tokens alone: a real eviction also finds some picks evicted
    (about 4 % of the columns in ``vllm_throughput.py``'s caches), which the torch path
    adds to its cosine block."""
    first = Observation(**{**vars(obs), "state": torch.full_like(obs.state, float("nan"))})
    _, state = policy.score(first)
    state[:, :, -policy.interval :] = float("nan")
    return Observation(**{**vars(obs), "state": state})


def ops(args, device) -> dict:
    r, n, h, d, bs = (4, 256, 2, 64, 16) if args.small else (64, 4096, 8, 128, 16)
    dtype = torch.float32 if args.small else torch.bfloat16
    interval = 32
    gen = torch.Generator().manual_seed(0)
    kv, table = paged_cache(r, n, h, d, bs, dtype, device, gen)
    e = kv.element_size()
    out = {
        "setting": "ops",
        "requests": r,
        "cache_tokens": n,
        "kv_heads": h,
        "head_dim": d,
        "dtype": str(dtype),
        "peak": peaks(device),
        "policies": {},
    }
    read_s, (keys, values) = timed(lambda: flash_read(kv, table, n), args.repeats, device)
    read_bytes = 2 * 2 * r * h * n * d * e
    out["read"] = {"ms": round(read_s * 1e3, 3), "gbs": round(read_bytes / read_s / 1e9, 1)}
    keys, values = keys.contiguous(), values.contiguous()
    for name in RULE_BASED:  # a learned scorer's cost is its MLP, not an eviction op
        policy = make_policy(name, budget=n - interval, interval=interval, window=16, sink=4)
        obs = observation(keys, values, policy, gen, device)
        row = {}
        if name in ("rkv", "gkv"):
            row["first_score_ms"] = round(timed(lambda: policy.score(obs), args.repeats, device)[0] * 1e3, 3)
            obs = steady_state(policy, obs)
        score_s, (scores, _) = timed(lambda: policy.score(obs), args.repeats, device)
        select_s, sel = timed(lambda: policy.select(obs, scores), args.repeats, device)
        counts = torch.full((r,), sel.keep.shape[-1], device=device)
        want, got = kv.clone(), kv.clone()
        reference.flash_compact(want, table, sel.keep, counts)
        flash_compact(got, table, sel.keep, counts)  # Triton on CUDA
        if not torch.equal(want, got):
            raise AssertionError(f"{name}: flash_compact differs from its torch reference")
        compact_s, _ = timed(lambda: flash_compact(got, table, sel.keep, counts), args.repeats, device)
        want = got = None  # 2 GiB of copies on a GPU
        compact_bytes = 2 * 2 * r * h * sel.keep.shape[-1] * d * e
        row.update(
            {
                "score_ms": round(score_s * 1e3, 3),
                "select_ms": round(select_s * 1e3, 3),
                "compact_ms": round(compact_s * 1e3, 3),
                "compact_gbs": round(compact_bytes / compact_s / 1e9, 1),
            }
        )
        if name != "streaming":  # its score reads positions only
            row["score_gbs"] = round(r * h * n * d * e / score_s / 1e9, 1)
        total_s = read_s + score_s + select_s + compact_s
        row["eviction_ms"] = round(total_s * 1e3, 3)
        row["us_per_request_and_layer"] = round(total_s / r * 1e6, 1)
        out["policies"][name] = row
    copy = out["peak"]["copy_gbs"]
    nominal = out["peak"].get("nominal_gbs")
    for part in [out["read"], *out["policies"].values()]:
        for key in [k for k in part if k.endswith("gbs")]:
            part[key.replace("gbs", "over_copy")] = round(part[key] / copy, 3)
            if nominal:
                part[key.replace("gbs", "over_nominal")] = round(part[key] / nominal, 3)
    return out


# ---------------------------------------------------------------- replay

QUESTIONS = [
    "What is 12 times 7?",
    "Solve 4y = 36 for y.",
    "Anna has 5 apples and gives Bob 2. How many are left?",
    "What is the sum of 3, 5 and 7?",
]


def replay(args, device) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvrl.engines.base import Sampling
    from kvrl.engines.hf import HFEngine
    from kvrl.envs.chat import Chat
    from kvrl.models import shrunk

    dtype = torch.float32 if args.small else torch.bfloat16
    new = 48 if args.small else 512
    schedule = (
        dict(budget=24, interval=8, window=4, sink=2) if args.small else dict(budget=64, interval=16, window=8, sink=4)
    )
    path = shrunk.build("qwen3", tempfile.mkdtemp())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    engine = HFEngine(model, AutoTokenizer.from_pretrained(path, padding_side="left"), chat=Chat())
    out = {
        "setting": "replay",
        "model": "shrunk qwen3",
        "dtype": str(dtype),
        "new_tokens": new,
        **schedule,
        "flex": device.type == "cuda",
        "regimes": {},
    }
    for name in ["full", *POLICIES]:
        policy = Full() if name == "full" else make_policy(name, model.config, **schedule)
        if getattr(policy, "trainable", lambda: None)() is not None:  # the learned scorer is built on the CPU
            policy.trainable().to(device)
        rollouts = engine.generate(
            QUESTIONS, Sampling(max_new_tokens=new, temperature=1.0, seed=1, ignore_eos=True), policy=policy
        )
        with torch.no_grad():
            scores = engine.score(rollouts, trace=rollouts.traces, policy=policy)
        gaps = torch.cat(
            [
                (scores.logprobs[b, : len(lp)].float().cpu() - torch.tensor(lp)).abs()
                for b, lp in enumerate(rollouts.logprobs)
            ]
        )
        evicted = 0 if rollouts.traces is None else int((rollouts.traces.full() < NEVER).sum())
        out["regimes"][name] = {
            "max_abs_dlogprob": float(gaps.max()),
            "mean_abs_dlogprob": float(gaps.mean()),
            "evicted_keys": evicted,
        }
    return out


# ---------------------------------------------------------------- flex


def flex(args, device) -> dict:
    from transformers import AutoModelForCausalLM

    from kvrl.kernels.reference.replay import visibility
    from kvrl.models import shrunk

    lengths = (512, 1024) if args.small else (8192, 32768)
    dtype = torch.float32 if args.small else torch.bfloat16
    path = shrunk.build("qwen3", tempfile.mkdtemp(), max_positions=max(lengths))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).train()
    cfg = model.config
    out = {
        "setting": "flex",
        "model": "shrunk qwen3",
        "dtype": str(dtype),
        "layers": cfg.num_hidden_layers,
        "lengths": {},
    }
    dense_attention = register_dense_masks()

    backward = device.type == "cuda"  # flex_attention has no backward on a CPU
    out["backward"] = backward

    def step(**attn):
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(backward):
            logits = model(input_ids=ids, position_ids=pos, **attn).logits
            if backward:
                logits.float().logsumexp(-1).mean().backward()
        return logits.detach()

    def measure(**attn) -> tuple[dict, torch.Tensor | None]:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            s, logits = timed(lambda: step(**attn), args.repeats, device)
        except torch.OutOfMemoryError:
            return {"s": "oom"}, None
        row = {"s": round(s, 4)}
        if device.type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        return row, logits

    for t in lengths:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (1, t), generator=gen).to(device)
        pos = torch.arange(t, device=device)[None]
        trace = EvictionTrace.from_death(
            synthetic_death(cfg.num_hidden_layers, cfg.num_key_value_heads, t).to(device),
            torch.tensor([t], device=device),
        )
        model.set_attn_implementation("kvrl_replay")
        flex_row, flex_logits = measure(kvrl_replay=trace.replay(pos, flex=True))
        model.set_attn_implementation(dense_attention)
        try:
            full = trace.full()
            dense = torch.stack([visibility(full[layer], pos, pos) for layer in range(cfg.num_hidden_layers)])
            dense_row, dense_logits = measure(dense_masks=dense)
            del dense
        except torch.OutOfMemoryError:
            dense_row, dense_logits = {"s": "oom"}, None
        row = {"flex": flex_row, "dense": dense_row}
        if flex_logits is not None and dense_logits is not None:
            row["logits_max_abs_diff"] = float((flex_logits.float() - dense_logits.float()).abs().max())
            if isinstance(dense_row["s"], float):
                row["flex_over_dense_time"] = round(flex_row["s"] / dense_row["s"], 3)
        out["lengths"][str(t)] = row
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("settings", nargs="*", choices=[[], "ops", "replay", "flex"], help="default: all three")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="shrunk shapes: a smoke run on a CPU")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and not args.small:
        raise SystemExit(
            "the full shapes need a GPU (64 × 4,096-token caches, 32K-token replays); "
            "pass --small for a smoke run on a CPU"
        )
    for setting in args.settings or ["ops", "replay", "flex"]:
        result = {"ops": ops, "replay": replay, "flex": flex}[setting](args, device)
        emit({"device": str(device), "torch": torch.__version__, **result})


if __name__ == "__main__":
    main()
