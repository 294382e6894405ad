"""RL-Sparse under G-KV through TRL (kvrl.integrations.trl.KVGRPOTrainer) and through kvrl's loop.

Both train the shipped tiny reasoner from the same weights, with ``recipes/tiny_gkv_sparse.yaml``'s
settings: G-KV at budget 76 (interval 16, window 8, sink 4, alpha 0.8, mix_lambda 0.5), 16 tasks x 8
samples a step from the counts tasks of seed 0's stream, 64 new tokens at temperature 2, lr 1e-3
constant, clip 0.2, no KL, token-level loss, group-normalised advantages, a truncated sample scored
like any other, grad norm 1.0. kvrl's loop runs in this process (``workers.address=inline``, the HF
engine, one learner), so that both sides' CPU is this process's and both decode with the same engine.
Then the untrained model and both trained ones are evaluated greedily under the same G-KV cache on
the same held-out tasks (seed ``--eval-seed``).

Prints one JSON line: each model's held-out accuracy under G-KV with its 95 % Wilson interval, each
side's gain over the untrained model, the train/inference mismatch (TRL side: the
``sampling/sampling_logp_difference`` metric; kvrl: ``mismatch_mean``/``mismatch_max``; the
worst step's), and samples per CPU-second of each whole training call (its start-up included).

    python benchmarks/learning/trl_rl_sparse.py [--steps 40] [--tasks 128]
    python benchmarks/learning/trl_rl_sparse.py --steps 1 --tasks 8 --prompts 2 --group 4   # smoke
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL's notice for rollout_func, which the adapter uses

from kvrl.bench import draw_tasks, emit, reasoner, recipe_policy, timed  # noqa: E402
from kvrl.config import load_config  # noqa: E402
from kvrl.eval.budgets import evaluate  # noqa: E402
from kvrl.eval.suite import wilson  # noqa: E402
from kvrl.runlog import setup_process  # noqa: E402

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
    env, tasks = draw_tasks(cfg.env.id, prompts * steps, cfg.seed, **cfg.env.kwargs)  # kvrl's stream: seed 0
    tasks = {t.id: t for t in tasks}
    data = Dataset.from_list([{"prompt": t.prompt, "task_id": t.id} for t in tasks.values()])

    def reward(completions, task_id, **_):
        return [env.score(tasks[i], c)[0] for i, c in zip(task_id, completions)]

    path = resolve_path(cfg.model.path)
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        learning_rate=cfg.trainer.lr,
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
    ap.add_argument("--eval-seed", type=int, default=4321)  # training draws from seed 0's stream
    ap.add_argument("--out", default="outputs/trl_rl_sparse")
    args = ap.parse_args()
    setup_process()
    out = Path(args.out)
    cfg = load_config(
        [
            f"recipe={RECIPE}",
            f"trainer.steps={args.steps}",
            f"output_dir={out / 'kvrl'}",
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

    env, tasks = draw_tasks(cfg.env.id, args.tasks, args.eval_seed, **cfg.env.kwargs)
    acc = {}

    def held_out(name: str, path: str) -> None:
        model, _, engine = reasoner(path)
        policy = recipe_policy(cfg.kv.policy, model.config, cfg.kv)
        a = evaluate(engine, env, tasks, cfg.sampling.max_new_tokens, policy=policy)["acc"]
        acc[name] = {"acc": round(a, 4), "ci95": [round(x, 4) for x in wilson(a, len(tasks))]}

    # first: it also loads what G-KV's first eviction loads, which would otherwise count in one side's CPU
    held_out("untrained", cfg.model.path)
    training = {"trl": train_trl(cfg, out), "kvrl": train_kvrl(cfg)}
    held_out("trl", str(out / "trl" / "model"))
    held_out("kvrl", str(out / "kvrl" / "model"))
    emit(
        {
            "benchmark": "trl_rl_sparse",
            "model": cfg.model.path,
            "tasks": args.tasks,
            "steps": args.steps,
            "samples_per_step": args.prompts * args.group,
            "seed": cfg.seed,
            "kv": {
                "policy": cfg.kv.policy,
                "budget": cfg.kv.budget,
                "interval": cfg.kv.interval,
                "window": cfg.kv.window,
                "sink": cfg.kv.sink,
                **cfg.kv.kwargs,
            },
            "acc_gkv": acc,
            "gain_points": {
                side: round(100 * (acc[side]["acc"] - acc["untrained"]["acc"]), 2) for side in ("trl", "kvrl")
            },
            "mismatch": {side: {k: t[k] for k in ("mismatch_mean", "mismatch_max")} for side, t in training.items()},
            "samples_per_cpu_s": {side: round(t["samples"] / t["cpu_s"], 2) for side, t in training.items()},
            "training": training,
        }
    )


if __name__ == "__main__":
    main()
