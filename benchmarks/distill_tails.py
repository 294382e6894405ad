"""#36, why Distill's sampled accuracy fell while its greedy accuracy rose. Prints one JSON line:

    python benchmarks/distill_tails.py untrained outputs/distill_lr/lr0.001_s0/checkpoints/step_000040/model \
        outputs/distill_lr/lr0.0003_s0/checkpoints/step_000040/model

Distill's sampled-accuracy decay at temperature 2: held-out accuracy under G-KV, greedy and
sampled at T=2 (4 seeds), untrained vs Distill checkpoints; and the share of probability the
model puts outside its top token at T=1 and T=2 under the full cache (its tails)."""
import json, sys
import numpy as np, torch
from kvrl.config import load_config
from kvrl.engines.hf import HFEngine
from kvrl.engines.base import Sampling
from kvrl.envs import make
from kvrl.models.tiny import load_model
from kvrl.policies import make_policy
torch.set_num_threads(1)
cfg = load_config(["recipe=tiny_gkv_distill"])
kv = cfg.kv
env = make(cfg.env.id, **cfg.env.kwargs); env.reset(seed=4321); tasks = env.tasks(64)
res = {}
for name in sys.argv[1:]:
    path = "tiny" if name == "untrained" else name
    model, tok = load_model(path)
    eng = HFEngine(model.eval(), tok)
    pol = make_policy("gkv", model.config, budget=kv.budget, interval=kv.interval, window=kv.window, sink=kv.sink, **kv.kwargs)
    r = {}
    for T in (0.0, 2.0):
        accs = []
        for seed in ([0] if T == 0 else [0, 1, 2, 3]):
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
print(json.dumps(res))
