"""Why Distill's sampled accuracy fell while its greedy accuracy rose. Prints one JSON line:

    python benchmarks/learning/distill_tails.py untrained outputs/distill_lr/lr0.001_s0/checkpoints/step_000040/model \
        outputs/distill_lr/lr0.0003_s0/checkpoints/step_000040/model

Distill's sampled-accuracy decay at temperature 2: held-out accuracy under G-KV, greedy and
sampled at T=2 (4 seeds), untrained vs Distill checkpoints; and the share of probability the
model puts outside its top token at T=1 and T=2 under the full cache (its tails)."""

import sys

import numpy as np
import torch

from kvrl.bench import draw_tasks, emit, reasoner, recipe_policy
from kvrl.config import load_config
from kvrl.engines.base import Sampling

torch.set_num_threads(1)
cfg = load_config(["recipe=tiny_gkv_distill"])
kv = cfg.kv
env, tasks = draw_tasks(cfg.env.id, 64, 4321, **cfg.env.kwargs)
res = {}
for name in sys.argv[1:]:
    path = "tiny" if name == "untrained" else name
    model, _, eng = reasoner(path)
    pol = recipe_policy("gkv", model.config, kv)
    r = {}
    for T in (0.0, 2.0):
        accs = []
        for seed in [0] if T == 0 else [0, 1, 2, 3]:
            out = eng.generate([t.prompt for t in tasks], Sampling(64, temperature=T, seed=seed), policy=pol)
            accs.append(float(np.mean([env.score(t, x)[0] for t, x in zip(tasks, out.texts)])))
        r[f"acc_T{T:g}"] = float(np.mean(accs))
    # tails on the greedy full-cache sequences
    out = eng.generate([t.prompt for t in tasks], Sampling(64))
    tails = {}
    with torch.no_grad():
        for T in (1.0, 2.0):
            sc = eng.score(out, temperature=T, distributions=True)
            probs = sc.distributions.exp()  # [B, G, V]
            top = probs.max(-1).values
            mask = sc.mask.float()
            tails[T] = [float(((1 - top) * mask).sum() / mask.sum())]
    r.update({f"tail_T{T:g}": float(np.mean(v)) for T, v in tails.items()})
    res[name] = r
emit(res)
