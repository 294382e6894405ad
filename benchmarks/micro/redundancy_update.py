"""Key redundancy at a vLLM eviction: the picks carried in the state against the stateless
full computation.

The vLLM engine's setting for R-KV / G-KV at 64 concurrent requests: B=64, H=2 KV heads,
N=288 slots (budget 256 + interval 32), U=32 new tokens, D=64, float32, CPU, 1 thread.
Prints one JSON line:

  speedup             stateless ``key_redundancy`` time / ``key_redundancy_update`` time on
                      the cache after one R-KV-like eviction (the 32 most redundant keys
                      evicted, 32 new keys appended), with that eviction's picks as state;
                      CPU time of the process, least of ``--repeats`` interleaved runs
                      (every run's times, mean, min and max: ``seconds``)
  stale_fraction      the old slots whose pick was evicted, in that setting
  stale{P}_speedup    the same with P % of the old slots' picks evicted as well (the columns
                      compared with the whole cache are then U + P % of the old ones; once
                      that is half of N in some head, the full pass runs)
  max_abs_diff        the largest difference between the two redundancies (all settings)

The keys are clustered (64 centres, noise, a shared offset) as in ``redundancy.py``.

    python benchmarks/micro/redundancy_update.py [--repeats 5]
"""

import argparse

import torch

from kvrl.bench import emit, interleaved
from kvrl.kernels import gather_slots, key_redundancy, key_redundancy_update

B, H, D, BUDGET, U = 64, 2, 64, 256, 32
N = BUDGET + U


def clustered(n: int, gen: torch.Generator) -> torch.Tensor:
    centres = torch.randn(B, H, 64, D, generator=gen)
    keys = centres[:, :, torch.randint(0, 64, (n,), generator=gen)]
    return keys + 0.8 * torch.randn(B, H, n, D, generator=gen) + 0.5 * torch.randn(B, H, 1, D, generator=gen)


def after_one_eviction(gen: torch.Generator):
    """(keys, key_pos, picks as state) of a cache at its second eviction."""
    keys = clustered(N + U, gen)
    pos = torch.arange(N + U).expand(B, H, -1)
    red, pick = key_redundancy_update(keys[:, :, :N], pos[:, :, :N], torch.full((B, H, N), float("nan")))
    keep = (-red).topk(BUDGET, -1).indices.sort(-1).values  # evict the U most redundant
    keys = torch.cat([gather_slots(keys[:, :, :N], keep), keys[:, :, N:]], 2)
    pos = torch.cat([gather_slots(pos[:, :, :N], keep), pos[:, :, N:]], 2)
    state = torch.cat([gather_slots(pick, keep), torch.full((B, H, U), float("nan"))], 2)
    return keys, pos, state


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    keys, pos, state = after_one_eviction(gen)
    valid = pos >= 0
    present = (state[..., :, None] == pos[..., None, :]).any(-1)  # the pick is still in the cache
    old = ~state.isnan()
    result = {"stale_fraction": round(float((old & (state >= 0) & ~present).sum() / old.sum()), 4)}
    settings = {"": state}
    gone = torch.ones(B, H, N + U, dtype=torch.bool).scatter_(-1, pos, False)
    evicted = gone.float().argmax(-1, keepdim=True).float()  # the first evicted position of each head
    for p in (10, 25, 50, 100):
        drop = (torch.rand(B, H, N, generator=gen) < p / 100) & old
        settings[f"stale{p}_"] = torch.where(drop, evicted, state)
    diff = 0.0
    for name, prev in settings.items():
        runs = interleaved(
            {
                "stateless": lambda: key_redundancy(keys, valid),
                "update": lambda prev=prev: key_redundancy_update(keys, pos, prev)[0],
            },
            args.repeats,
        )
        t_full, t_inc = min(runs["stateless"].cpu_s), min(runs["update"].cpu_s)
        for want, got in zip(runs["stateless"].outs, runs["update"].outs):
            diff = max(diff, float((got - want).abs().max()))
        result[f"{name}speedup"] = round(t_full / t_inc, 2)
        if not name:
            result["stateless_ms"], result["update_ms"] = round(1e3 * t_full, 2), round(1e3 * t_inc, 2)
            result["seconds"] = {k: r.summary(5) for k, r in runs.items()}
    result["max_abs_diff"] = float(f"{diff:.3g}")
    emit(result)


if __name__ == "__main__":
    main()
