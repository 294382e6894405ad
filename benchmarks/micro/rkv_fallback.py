"""How much R-KV's reference quirks kvrl drops by default move R-KV's scores and kept sets.

Two departures of ``RKV()`` from the paper's code (``rkv/utils.py::cal_similarity``), each
switched on and off on the same caches:

  fallback   a token with no near-duplicate zeroes its cosine with token 0 in the reference
             (``RKV(fallback=True)``); per threshold: the largest relative change of token
             0's redundancy (``token0_change_max``) and the caches whose kept set changes
             (``kept_changed``)
  eps        the key norms' epsilon, 1e-8 in R-KV and 1e-6 in kvrl (G-KV's): the largest
             relative change of any token's redundancy, at threshold 0.5

The caches: random keys with a shared offset (real keys share a large mean direction; the
offset's scale sets how many pairs are near duplicates), N = 64 slots, D = 32, 8 observation
queries of 2 query heads, budget 32, 50 seeds per offset scale in 0.5, 0.8, 1.0, 1.2. Prints
one JSON line.

    python benchmarks/micro/rkv_fallback.py
"""

import torch

from kvrl.bench import emit
from kvrl.kernels import key_redundancy
from kvrl.policies import RKV, Observation

N, D, W, BUDGET, SEEDS, OFFSETS = 64, 32, 8, 32, 50, (0.5, 0.8, 1.0, 1.2)


def caches():
    for offset in OFFSETS:
        for seed in range(SEEDS):
            g = torch.Generator().manual_seed(seed)
            keys = torch.randn(1, 1, N, D, generator=g) + offset * torch.randn(1, 1, 1, D, generator=g)
            yield Observation(
                keys=keys,
                values=keys,
                queries=torch.randn(1, 2, W, D, generator=g),
                key_pos=torch.arange(N).view(1, 1, N),
                query_pos=torch.arange(N - W, N).view(1, W),
                state=None,
                layer=0,
                scaling=D**-0.5,
            )


def kept(policy, obs) -> set:
    return set(policy.select(obs, policy.score(obs)[0]).keep[0, 0].tolist())


def main():
    out = {"caches": len(OFFSETS) * SEEDS}
    valid = torch.ones(1, 1, N, dtype=torch.bool)
    for threshold in (0.5, 0.7):
        change, changed = 0.0, 0
        for obs in caches():
            plain = key_redundancy(obs.keys, valid, threshold)[0, 0, 0]
            quirk = key_redundancy(obs.keys, valid, threshold, fallback=True)[0, 0, 0]
            change = max(change, float((plain - quirk).abs() / plain))
            changed += kept(RKV(budget=BUDGET, window=W, threshold=threshold), obs) != kept(
                RKV(budget=BUDGET, window=W, threshold=threshold, fallback=True), obs
            )
        out[f"fallback_t{threshold}_token0_change_max"] = round(change, 5)
        out[f"fallback_t{threshold}_kept_changed"] = changed
    change = 0.0
    for obs in caches():
        a = key_redundancy(obs.keys, valid, eps=1e-6)
        b = key_redundancy(obs.keys, valid, eps=1e-8)
        change = max(change, float(((a - b).abs() / b).max()))
    out["eps_redundancy_change_max"] = float(f"{change:.3g}")
    emit(out)


if __name__ == "__main__":
    main()
