"""The key-redundancy score (R-KV, G-KV): the tiled kernel against the dense one it replaced.

Prints one JSON line, both implementations measured side by side in this run on the same
inputs (B=16, H=8, D=128, float32, CPU, 1 thread; N in 512, 2048, 4096):

  n{N}_speedup        old time / new time: the least of ``--repeats`` interleaved runs each,
                      in CPU time of the process (:func:`kvrl.bench.timed`: with one torch
                      thread this is the op time, and it does not count the time other
                      processes on a shared machine take the core away; wall-clock ratios are
                      also given, as ``n{N}_speedup_wall``, and every run's times as
                      ``n{N}_seconds``: mean, min and max)
  n{N}_memory_ratio   new peak / old peak: the rise of the resident set (VmHWM after a reset
                      through /proc/self/clear_refs, minus VmRSS before the call) over one
                      call, each in a fresh subprocess with glibc's mmap threshold at 64 KiB
                      so that freed tensors leave the resident set
  n{N}_max_abs_diff   the largest difference between the two results
  n{N}_heads_per_call the B·H heads are scored in calls of this many heads (both
                      implementations alike): all 128 unless the dense version's N×N
                      temporaries (measured ≈ 15 bytes per head·N²) would not fit in half the
                      available memory (N=4096 needs ≈ 32 GB for 128 heads)

The keys are clustered (64 centres, noise, a shared offset), so that many pairs are near
duplicates as in real caches, with 5 % invalid slots.

    python benchmarks/micro/redundancy.py [--ns 512,2048,4096] [--repeats 2] [--heads-per-call 0]
"""

import argparse
import os
import re
import subprocess
import sys

import torch

from kvrl.bench import emit, interleaved
from kvrl.kernels import key_redundancy

B, H, D = 16, 8, 128
OLD_BYTES_PER_PAIR = 16  # dense_redundancy's peak per head and N²: 15.0 at N = 512, 14.5 at 1024


def dense_redundancy(keys, valid, threshold=0.5, *, eps=1e-6):
    """The implementation ``key_redundancy`` replaced (kvrl before the tiled kernel)."""
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + eps)
    cos = k @ k.transpose(-1, -2)
    n = cos.shape[-1]
    slots = torch.arange(n, device=keys.device)
    pair = valid[..., :, None] & valid[..., None, :] & (slots[:, None] != slots[None, :])
    cos = cos.masked_fill(~pair, 0.0)
    latest = torch.where((cos > threshold) & pair, slots[:, None], -1).amax(-2)
    cos = cos.masked_fill(slots[:, None] == latest[..., None, :], 0.0)
    score = cos.sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1)
    return score.masked_fill(~valid, float("-inf")).softmax(-1).nan_to_num(0.0)


IMPLS = {"old": dense_redundancy, "new": key_redundancy}


def inputs(n: int, seed: int = 0):
    """Keys [1, B·H, N, D] and valid [1, B·H, N] (the B·H heads flattened, to split them)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(1, B * H, 64, D, generator=gen)
    keys = centres[:, :, torch.randint(0, 64, (n,), generator=gen)]
    keys += 0.8 * torch.randn(1, B * H, n, D, generator=gen) + 0.5 * torch.randn(1, B * H, 1, D, generator=gen)
    valid = torch.rand(1, B * H, n, generator=gen) > 0.05
    return keys, valid


def heads_per_call(n: int, requested: int) -> int:
    if requested:
        return requested
    avail = int(re.search(r"MemAvailable:\s+(\d+)", open("/proc/meminfo").read()).group(1)) * 1024
    return max(1, min(B * H, int(0.5 * avail // (OLD_BYTES_PER_PAIR * n * n))))


def run(impl: str, keys, valid, per_call: int):
    fn = IMPLS[impl]
    return torch.cat(
        [fn(keys[:, h : h + per_call], valid[:, h : h + per_call]) for h in range(0, keys.shape[1], per_call)], 1
    )


def status() -> dict[str, int]:
    text = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def peak_child(impl: str, n: int, per_call: int) -> None:
    """In a fresh process: the resident-set rise over one call."""
    torch.set_num_threads(1)
    keys, valid = inputs(n)
    run(impl, keys[:, :1, :8], valid[:, :1, :8], 1)  # load the code paths
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = status()["VmRSS"]
    run(impl, keys, valid, per_call)
    print(status()["VmHWM"] - before)


def peak(impl: str, n: int, per_call: int) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, __file__, "--peak", impl, str(n), str(per_call)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(out.split()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="512,2048,4096")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--heads-per-call", type=int, default=0, help="0: all B·H heads if the old version fits")
    ap.add_argument("--peak", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak:
        peak_child(args.peak[0], int(args.peak[1]), int(args.peak[2]))
        return
    torch.set_num_threads(1)
    result = {}
    for n in (int(x) for x in args.ns.split(",")):
        per_call = heads_per_call(n, args.heads_per_call)
        keys, valid = inputs(n)
        runs = interleaved(
            {impl: lambda impl=impl: run(impl, keys, valid, per_call) for impl in ("old", "new")}, args.repeats
        )
        old, new = runs["old"], runs["new"]
        result[f"n{n}_speedup"] = round(min(old.cpu_s) / min(new.cpu_s), 2)
        result[f"n{n}_speedup_wall"] = round(min(old.wall_s) / min(new.wall_s), 2)
        result[f"n{n}_new_seconds"] = round(min(new.cpu_s), 3)
        result[f"n{n}_seconds"] = {impl: r.summary(3) for impl, r in runs.items()}
        result[f"n{n}_max_abs_diff"] = float(f"{(old.outs[-1] - new.outs[-1]).abs().max().item():.3g}")
        del runs, old, new
        old_peak, new_peak = peak("old", n, per_call), peak("new", n, per_call)
        result[f"n{n}_memory_ratio"] = round(new_peak / old_peak, 4)
        result[f"n{n}_peak_mib"] = {"old": round(old_peak / 2**20), "new": round(new_peak / 2**20)}
        result[f"n{n}_heads_per_call"] = per_call
    emit(result)


if __name__ == "__main__":
    main()
