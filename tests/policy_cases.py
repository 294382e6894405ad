"""What the KV-policy tests share: the cache geometry, one small configuration per policy, a
mid-generation observation of that geometry, and NumPy's softmax for hand-computed values.
"""

import numpy as np
import torch

from kvrl.policies import POLICIES, KVPolicy, Observation

B, H, G, D, N, T = 3, 2, 2, 8, 28, 40  # cache of N slots; the newest token is at position T-1
INVALID = ([], [0, 1, 2], [0, 1, 2, 3, 4, 12])  # per row: padding, and a hole mid-cache in row 2


# One small configuration per policy (kvpress `default_presses` style); every contract test
# runs on all of them.
POLICY_KWARGS = {
    "streaming": dict(budget=12, window=3, sink=2, interval=6),
    "h2o": dict(budget=12, window=3, interval=6),
    "snapkv": dict(budget=12, window=4),
    "rkv": dict(budget=12, window=4),
    "gkv": dict(budget=12, window=4, sink=1, kernel_size=3),
    "learned": dict(budget=12, window=4, interval=6, group=G, head_dim=D, layers=2, kv_heads=H),
}
assert set(POLICY_KWARGS) == set(POLICIES)


def make_obs(policy: KVPolicy, seed: int = 0, invalid=INVALID) -> Observation:
    """A mid-generation cache: compacted older positions (per-head sets), the last `observe`
    tokens contiguous (they are the observation queries), padding, near-duplicate keys, and
    a state whose newest tokens hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    w = policy.observe
    key_pos = torch.full((B, H, N), -1)
    for b, bad in enumerate(invalid):
        slots = [n for n in range(N) if n not in bad]
        n_old = len(slots) - w
        for h in range(H):
            old = torch.randperm(T - w, generator=gen)[:n_old].sort().values
            key_pos[b, h, slots] = torch.cat([old, torch.arange(T - w, T)])
    keys = torch.randn(B, H, N, D, generator=gen)
    keys[:, :, 9] = keys[:, :, 6] + 0.1 * torch.randn(B, H, D, generator=gen)  # near-duplicates
    keys[:, :, 20] = keys[:, :, 6]
    state = None
    if policy.state_size:
        state = torch.rand(B, H, N, policy.state_size, generator=gen)
        state[:, :, -w:] = float("nan")  # tokens decoded since the last eviction
    return Observation(
        keys=keys,
        values=torch.randn(B, H, N, D, generator=gen),
        queries=2 * torch.randn(B, H * G, w, D, generator=gen),
        key_pos=key_pos,
        query_pos=torch.arange(T - w, T).expand(B, w),
        state=state,
        layer=1,
        scaling=D**-0.5,
    )


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()
