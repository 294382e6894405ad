"""Peak host memory of RLKV's mixed-gate attention, forward and backward, with one mask per
sequence (key positions shared by the heads: the learner's case, broadcast over the query
heads) against one mask per query head (forced here by
per-head key positions, which give the same outputs). Each side runs in its own process and
reports its peak RSS above the process's baseline. Prints one JSON line.

    python benchmarks/system/mixed_memory.py [--seq 1024] [--batch 2] [--heads 16] [--kv-heads 2]
"""

import argparse
import subprocess
import sys

from kvrl.bench import emit

CHILD = """
import resource, sys, torch
from kvrl.kernels.reference.mixed import mixed_gate_attention
b, hq, h, s, d, per_head = {b}, {hq}, {h}, {s}, 64, {per_head}
g = torch.Generator().manual_seed(0)
q = torch.randn(b, hq, s, d, generator=g, requires_grad=True)
k = torch.randn(b, h, s, d, generator=g, requires_grad=True)
v = torch.randn(b, h, s, d, generator=g, requires_grad=True)
pos = torch.arange(s).expand(b, s)
key_pos = pos[:, None].expand(b, h, s).contiguous() if per_head else pos
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = mixed_gate_attention(q, k, v, pos, key_pos, torch.full((h,), 0.5), sink=4, recent=64, scaling=d ** -0.5)
out.square().sum().backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - base) * 1024, float(out.detach().double().sum()))
"""


def run(per_head: bool, args) -> tuple[int, float]:
    code = CHILD.format(b=args.batch, hq=args.heads, h=args.kv_heads, s=args.seq, per_head=per_head)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak, checksum = res.stdout.split()
    return int(peak), float(checksum)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    args = ap.parse_args()
    shared, out_shared = run(False, args)
    per_head, out_per_head = run(True, args)
    emit(
        {
            "benchmark": "mixed_memory",
            "seq": args.seq,
            "batch": args.batch,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "peak_bytes_shared_mask": shared,
            "peak_bytes_per_head_masks": per_head,
            "shared_over_per_head": round(shared / per_head, 3),
            "outputs_equal": abs(out_shared - out_per_head) <= 1e-6 * abs(out_per_head),
        }
    )


if __name__ == "__main__":
    main()
