"""RL-Sparse under G-KV through TRL (kvrl.integrations.trl.KVGRPOTrainer) and through kvrl's loop.

Both train the shipped tiny reasoner from the same weights, with ``recipes/tiny_gkv_sparse.yaml``'s
settings: G-KV at budget 76 (interval 16, window 8, sink 4, alpha 0.8, mix_lambda 0.5), 16 tasks x 8
samples a step from the counts tasks of the seed's stream, 64 new tokens at temperature 2, lr 1e-4
constant, clip 0.2, no KL, token-level loss, group-normalised advantages, a truncated sample scored
like any other, grad norm 1.0, AdamW with the betas of kvrl's learner (0.9, 0.99). kvrl's loop runs in
this process (``workers.address=inline``, the HF engine, one learner), so that both sides' CPU is this
process's and both decode with the same engine.
Then the untrained model and both trained ones are evaluated greedily under the same G-KV cache on
the same held-out tasks (seed ``--eval-seed``).

Runs every seed of ``--seeds`` (each trains both sides from the same weights, on that seed's task stream
and sampling seed: RL-Sparse on counts depends on its seed, benchmarks/learning/gkv_sparse_seeds.py).
Prints one JSON line and records it in ``benchmarks/results/trl_rl_sparse.json``: per seed, each model's
held-out accuracy under G-KV with its 95 % Wilson interval and its gain over the untrained model; pooled
over the seeds, each side's accuracy (seeds x tasks) with its interval, and whether the adapter's falls in
the loop's; the train/inference mismatch (TRL side: the
``sampling/sampling_logp_difference`` metric; kvrl: ``mismatch_mean``/``mismatch_max``; the
worst step's), and samples per CPU-second of each whole training call (its start-up included).

    python benchmarks/learning/trl_rl_sparse.py [--steps 40] [--tasks 128] [--seeds 0,1,2]
    python benchmarks/learning/trl_rl_sparse.py --steps 1 --tasks 8 --prompts 2 --group 4 --seeds 0   # smoke
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL's notice for rollout_func, which the adapter uses

from kvrl.bench import draw_tasks, evaluate_under_recipe, record, timed  # noqa: E402
from kvrl.config import load_config  # noqa: E402
from kvrl.eval.suite import wilson  # noqa: E402
from kvrl.runlog import setup_process  # noqa: E402
from kvrl.workers.learner import ADAM_BETAS  # noqa: E402

RECIPE = "tiny_gkv_sparse"


def train_kvrl(cfg) -> dict:
    from kvrl.jobs.rl import main as train

    cpu, wall, _ = timed(lambda: train(cfg))
    records = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return {
        "cpu_s": round(cpu, 1),
        "wall_s": round(wall, 1),
        "samples": records[-1]["samples_total"],
        "mismatch_mean": max(r["mismatch_mean"] for r in records),
        "mismatch_max": max(r["mismatch_max"] for r in records),
    }


def train_trl(cfg, out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from kvrl.integrations.trl import MISMATCH, KVGRPOTrainer
    from kvrl.models.tiny import resolve_path

    steps, group = cfg.trainer.steps, cfg.rl.group_size
    prompts = cfg.trainer.batch_size // group
    env, tasks = draw_tasks(cfg.env.id, prompts * steps, cfg.seed, **cfg.env.kwargs)  # the stream kvrl's loop draws
    tasks = {t.id: t for t in tasks}
    data = Dataset.from_list([{"prompt": t.prompt, "task_id": t.id} for t in tasks.values()])

    def reward(completions, task_id, **_):
        return [env.score(tasks[i], c)[0] for i, c in zip(task_id, completions)]

    path = resolve_path(cfg.model.path)
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        learning_rate=cfg.trainer.lr,
        adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1],  # TRL's default 0.999 would be another optimizer than the loop's
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=cfg.trainer.max_grad_norm,
        per_device_train_batch_size=prompts * group,
        gradient_accumulation_steps=1,
        num_generations=group,
        max_completion_length=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=cfg.rl.eps_low,
        epsilon_high=cfg.rl.eps_high,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=cfg.seed,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kv = cfg.kv
    trainer = KVGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(path),
        kv_policy=kv.policy,
        kv_budget=kv.budget,
        kv_interval=kv.interval,
        kv_window=kv.window,
        kv_sink=kv.sink,
        kv_kwargs=dict(kv.kwargs),
    )
    cpu, wall, _ = timed(trainer.train)
    trainer.save_model(str(out / "trl" / "model"))
    trainer.processing_class.save_pretrained(str(out / "trl" / "model"))
    logs = [r for r in trainer.state.log_history if f"{MISMATCH}/max" in r]
    return {
        "cpu_s": round(cpu, 1),
        "wall_s": round(wall, 1),
        "samples": steps * prompts * group,
        "mismatch_mean": max(r[f"{MISMATCH}/mean"] for r in logs),
        "mismatch_max": max(r[f"{MISMATCH}/max"] for r in logs),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tasks", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16, help="tasks per step (the recipe's 128 samples / 8)")
    ap.add_argument("--group", type=int, default=8, help="samples per task")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds; each trains both sides")
    ap.add_argument("--eval-seed", type=int, default=4321)  # training draws from the seed's stream
    ap.add_argument("--out", default="outputs/trl_rl_sparse")
    args = ap.parse_args()
    setup_process()
    seeds = [int(x) for x in args.seeds.split(",")]

    def config(seed: int):
        return load_config(
            [
                f"recipe={RECIPE}",
                f"seed={seed}",
                f"trainer.steps={args.steps}",
                f"output_dir={Path(args.out) / f'seed{seed}' / 'kvrl'}",
                f"trainer.batch_size={args.prompts * args.group}",
                f"rl.group_size={args.group}",
                "resume=never",
                "rl.checkpoint_every=0",
                "workers.address=inline",
                "workers.engine=hf",
                "workers.learners=1",
                "workers.backend=ddp",
            ]
        )

    cfg = config(seeds[0])
    env, tasks = draw_tasks(cfg.env.id, args.tasks, args.eval_seed, **cfg.env.kwargs)

    def held_out(path: str) -> float:
        return evaluate_under_recipe(path, cfg, env, tasks)["acc"]

    def interval(acc: float, n: int) -> dict:
        return {"acc": round(acc, 4), "ci95": [round(x, 4) for x in wilson(acc, n)]}

    # first: it also loads what G-KV's first eviction loads, which would otherwise count in one side's CPU
    untrained = held_out(cfg.model.path)
    runs, accs = {}, {"trl": [], "kvrl": []}
    for seed in seeds:
        cfg = config(seed)
        out = Path(args.out) / f"seed{seed}"
        training = {"trl": train_trl(cfg, out), "kvrl": train_kvrl(cfg)}
        acc = {"trl": held_out(str(out / "trl" / "model")), "kvrl": held_out(str(out / "kvrl" / "model"))}
        for side, a in acc.items():
            accs[side].append(a)
        runs[seed] = {
            "acc_gkv": {side: interval(a, len(tasks)) for side, a in acc.items()},
            "gain_points": {side: round(100 * (a - untrained), 2) for side, a in acc.items()},
            "mismatch": {side: {k: t[k] for k in ("mismatch_mean", "mismatch_max")} for side, t in training.items()},
            "samples_per_cpu_s": {side: round(t["samples"] / t["cpu_s"], 2) for side, t in training.items()},
            "training": training,
        }
    # every seed's held-out tasks pooled: each side's accuracy over seeds x tasks, with its interval
    pooled = {side: interval(sum(a) / len(a), len(a) * len(tasks)) for side, a in accs.items()}
    record(
        "trl_rl_sparse",
        {
            "benchmark": "trl_rl_sparse",
            "model": cfg.model.path,
            "tasks": args.tasks,
            "eval_seed": args.eval_seed,
            "steps": args.steps,
            "samples_per_step": args.prompts * args.group,
            "lr": cfg.trainer.lr,
            "adam_betas": list(ADAM_BETAS),
            "seeds": seeds,
            "kv": {
                "policy": cfg.kv.policy,
                "budget": cfg.kv.budget,
                "interval": cfg.kv.interval,
                "window": cfg.kv.window,
                "sink": cfg.kv.sink,
                **cfg.kv.kwargs,
            },
            "untrained": interval(untrained, len(tasks)),
            "pooled": pooled,
            "pooled_gain_points": {side: round(100 * (a["acc"] - untrained), 2) for side, a in pooled.items()},
            "trl_within_kvrl_interval": pooled["kvrl"]["ci95"][0] <= pooled["trl"]["acc"] <= pooled["kvrl"]["ci95"][1],
            "per_seed": runs,
        },
    )


if __name__ == "__main__":
    main()
