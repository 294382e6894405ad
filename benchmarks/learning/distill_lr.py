"""tiny_gkv_distill at a given learning rate and seed: its training metrics per step (sampled
accuracy at temperature 2, KL to the teacher, truncation) and the greedy accuracy under the recipe's
G-KV cache of every 5-step checkpoint on benchmarks/learning/gkv_train.py's 128 held-out tasks. Prints
one JSON line. The figures in docs/studies.md are seed 0 at 1e-3 and at 3e-4:

    python benchmarks/learning/distill_lr.py 0.001 0 40 outputs/distill_lr
    python benchmarks/learning/distill_lr.py 0.0003 0 40 outputs/distill_lr
"""

import json
import sys
from pathlib import Path

import torch

from kvrl.bench import draw_tasks, emit, evaluate_under_recipe, timed
from kvrl.config import load_config
from kvrl.jobs.rl import main as train

lr, seed, steps, out = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
root = Path(out) / f"lr{lr}_s{seed}"
torch.set_num_threads(1)
cfg = load_config(
    [
        "recipe=tiny_gkv_distill",
        f"trainer.steps={steps}",
        f"trainer.lr={lr}",
        f"seed={seed}",
        f"output_dir={root}",
        "resume=auto",
        "rl.checkpoint_every=5",
    ]
)
_, train_s, _ = timed(lambda: train(cfg))
recs = [json.loads(l) for l in (root / "metrics.jsonl").read_text().splitlines()]
env, tasks = draw_tasks(cfg.env.id, 128, 4321, **cfg.env.kwargs)
acc = {}
ckpts = {0: "tiny"}
for d in sorted((root / "checkpoints").glob("step_*")):
    if (d / "model").exists():
        ckpts[int(d.name.split("_")[1])] = str(d / "model")
for step, path in sorted(ckpts.items()):
    acc[step] = evaluate_under_recipe(path, cfg, env, tasks)["acc"]  # the recipe's cache: G-KV at 76
emit(
    {
        "lr": lr,
        "seed": seed,
        "train_s": round(train_s),
        "acc_gkv_heldout": acc,
        "correct": [round(r["env/correct"], 3) for r in recs],
        "kl": [round(r.get("kl", float("nan")), 4) for r in recs],
        "truncated": [round(r["truncated"], 2) for r in recs],
    }
)
