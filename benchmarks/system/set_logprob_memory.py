"""Peak host memory of ForesightKV's stage-2 learner term, the exact Top-K set log-probability
(``kvrl.policies.learned.topk_set_logprob``), forward and backward, on a batch shaped like a multihop
stage-2 step at a tight budget: most decisions draw the eviction interval's 16 tokens, each episode's
first decisions (one per layer) draw ~110 (its first eviction down to the budget). Grouped (rows taken in
groups of like set size, as kvrl computes it) against padded (every row's quadrature padded to the
largest set, one call of the same integral). Each side runs in its own process and reports its peak RSS
above the process's baseline, with its log-probabilities' and gradient's sums, which must agree.
Prints one JSON line.

    python benchmarks/system/set_logprob_memory.py [--episodes 8] [--decisions 64] [--heads 2] [--candidates 256]
"""

import argparse
import subprocess
import sys

from kvrl.bench import emit

CHILD = """
import resource, torch
from kvrl.policies import learned
b, d, h, n, small, large, first = {b}, {d}, {h}, {n}, {small}, {large}, {first}
g = torch.Generator().manual_seed(0)
evict = torch.randn(b, d, h, n, generator=g, dtype=torch.float32).requires_grad_()
pool = torch.ones(b, d, h, n, dtype=torch.bool)
sizes = torch.full((b, d, h), small)
sizes[:, :first] = large
order = torch.rand(b, d, h, n, generator=g).argsort(-1)
drawn = order < sizes[..., None]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
fn = learned.topk_set_logprob if {grouped} else learned._set_logprob
logp = fn(evict, pool, drawn)
logp.sum().backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - base) * 1024, float(logp.detach().double().sum()), float(evict.grad.double().abs().sum()))
"""


def run(grouped: bool, args) -> tuple[int, float, float]:
    code = CHILD.format(
        b=args.episodes,
        d=args.decisions,
        h=args.heads,
        n=args.candidates,
        small=args.small,
        large=args.large,
        first=args.layers,
        grouped=grouped,
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak, logp, grad = res.stdout.split()
    return int(peak), float(logp), float(grad)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=8, help="episodes in the learner's micro-batch")
    ap.add_argument("--decisions", type=int, default=64, help="decisions an episode (layers x eviction steps)")
    ap.add_argument("--heads", type=int, default=2, help="KV heads")
    ap.add_argument("--candidates", type=int, default=256, help="candidate tokens a decision, padded")
    ap.add_argument("--small", type=int, default=16, help="tokens drawn by a decision after the first")
    ap.add_argument("--large", type=int, default=112, help="tokens drawn by an episode's first decisions")
    ap.add_argument("--layers", type=int, default=2, help="first decisions (one per layer) that draw --large")
    args = ap.parse_args()
    grouped, logp_grouped, grad_grouped = run(True, args)
    padded, logp_padded, grad_padded = run(False, args)
    emit(
        {
            "benchmark": "set_logprob_memory",
            **{k: v for k, v in vars(args).items()},
            "peak_bytes_grouped": grouped,
            "peak_bytes_padded": padded,
            "grouped_over_padded": round(grouped / padded, 3),
            "logprobs_equal": abs(logp_grouped - logp_padded) <= 1e-6 * abs(logp_padded),
            "grads_equal": abs(grad_grouped - grad_padded) <= 1e-6 * abs(grad_padded),
        }
    )


if __name__ == "__main__":
    main()
