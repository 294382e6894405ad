"""kvrl's RL loop against TRL's GRPOTrainer: samples per CPU-second and start-up CPU.

The same tiny model, prompts and hyperparameters in both. This runs both, interleaved, each in its own process tree:

* kvrl: ``python -m kvrl.run recipe=tiny_rl_full`` (2 rollout actors and a learner on a
  private local Ray; Ray's daemons count too);
* kvrl_inline: the same with ``workers.address=inline`` (the same actors as objects in the
  one process, no Ray; it gives the Ray run's metrics and weights exactly);
* TRL: ``GRPOTrainer`` in one process with HF ``generate``, on the same shipped tiny
  reasoner and ``kvrl/counts-v0`` tasks (seed 0), scored by the environment's own reward,
  with the recipe's hyperparameters: 16 prompts x 8 samples a step, 64 new tokens at
  temperature 2.5 (no top-k / top-p), lr 3e-4 constant, clip 0.2, no KL, token-level
  ("dapo") loss, group-normalised advantages, grad norm 1.0, one torch thread (``--trl-threads``)
  as each kvrl process has. Not matched: kvrl zeroes a truncated sample's reward
  (``rl.truncated: zero``), TRL scores it like any other; kvrl's processes flush denormals
  (``kvrl.runlog.setup_process``), the TRL process does not (over a few steps they are rare).

Every 0.2 s the parent sums user+system CPU over the child and all its descendants (the
last value seen for each pid, so an exited worker still counts). A run's steps are seen
when its progress file grows. Per-sample CPU is taken between the end of step 1 and the end
of the last step; start-up CPU is the tree's CPU at the end of step 1 less one step's CPU.
Prints one JSON line (mean and spread over ``--repeats``; wall seconds from
:func:`kvrl.bench.interleaved`).

    python benchmarks/system/trl_compare.py [--steps 6] [--repeats 2]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from kvrl.bench import draw_tasks, emit, interleaved, spread

REPO = Path(__file__).resolve().parents[2]
PROMPTS, GROUP, NEW_TOKENS = 16, 8, 64
SIDES = ("kvrl", "kvrl_inline", "trl")  # kvrl on a private local Ray; kvrl with workers.address=inline; TRL


def run_trl(steps: int, out: Path, threads: int) -> None:
    """The TRL side, in this (child) process; one line a step in out/progress.jsonl."""
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from kvrl.models.tiny import resolve_path

    env, tasks = draw_tasks("kvrl/counts-v0", PROMPTS * steps, 0, n_digits=24)  # the kvrl run's stream: seed 0
    tasks = {t.id: t for t in tasks}
    data = Dataset.from_list([{"prompt": t.prompt, "task_id": t.id} for t in tasks.values()])

    def reward(prompts, completions, task_id, **_):
        return [env.score(tasks[i], c)[0] for i, c in zip(task_id, completions)]

    progress = open(out / "progress.jsonl", "a")

    class Progress(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            progress.write(json.dumps({"step": state.global_step, "t": time.time()}) + "\n")
            progress.flush()

    path = resolve_path("tiny")
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        temperature=2.5,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(path),
        callbacks=[Progress()],
    )
    trainer.train()


ACTORS = (("RolloutWorker", "rollout_actors"), ("Learner", "learner_actor"))


def kind(p: psutil.Process) -> str | None:
    """What a process is, by its command line (Ray retitles a worker ray::CLASS.method); None
    while it has none to read (exec'ing, or exited: its kind is the one seen before)."""
    cmd = p.cmdline()
    if not cmd:
        return None
    first, whole = (cmd[0] if cmd else ""), " ".join(cmd)
    for text, k in ACTORS:
        if text in whole:
            return k
    for end, k in (("/raylet", "raylet"), ("/gcs_server", "gcs")):
        if first.endswith(end):
            return k
    if "kvrl.run" in whole:
        return "driver"
    if "--child" in whole:
        return "trl_process"
    if first.startswith("ray::IDLE") or "default_worker.py" in whole:
        return "idle_workers"
    return "other_ray_daemons"  # the dashboard's API process, the agents, the monitors


def tree_cpu(root: psutil.Process, seen: dict[int, float], kinds: dict[int, str]) -> float:
    """CPU seconds of ``root`` and its descendants: each pid's last-seen own user+system."""
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            seen[p.pid] = max(seen.get(p.pid, 0.0), t.user + t.system)
            if kinds.get(p.pid) not in dict(ACTORS).values() and (k := kind(p)):  # an idle worker may become one
                kinds[p.pid] = k
        except psutil.Error:
            pass
    return sum(seen.values())


def measure(side: str, steps: int, tmp: Path, threads: int) -> dict:
    out = tmp / f"{side}-{time.monotonic_ns()}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    if side.startswith("kvrl"):
        cmd = [
            sys.executable,
            "-m",
            "kvrl.run",
            "recipe=tiny_rl_full",
            f"trainer.steps={steps}",
            f"output_dir={out}",
            "rl.checkpoint_every=0",
            *(["workers.address=inline"] if side == "kvrl_inline" else []),
        ]
        progress = out / "metrics.jsonl"
    else:
        cmd = [sys.executable, __file__, "--child", str(out), "--steps", str(steps), "--trl-threads", str(threads)]
        env["OMP_NUM_THREADS"] = str(threads)
        progress = out / "progress.jsonl"
    seen: dict[int, float] = {}
    kinds: dict[int, str] = {}
    at: dict[int, float] = {}  # step -> tree CPU when its line appeared
    pids_at: dict[int, dict[int, float]] = {}  # step -> each pid's CPU then
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            cpu = tree_cpu(root, seen, kinds)
            done = len(progress.read_text().splitlines()) if progress.exists() else 0
            for k in range(len(at) + 1, done + 1):
                at[k], pids_at[k] = cpu, dict(seen)
            time.sleep(0.2)
    if proc.returncode or len(at) < steps:
        raise RuntimeError(
            f"{side} failed ({proc.returncode}), see {out / 'log.txt'}:\n" + (out / "log.txt").read_text()[-3000:]
        )
    per_step = (at[steps] - at[1]) / (steps - 1)
    by_kind: dict[str, float] = {}  # where a step's CPU goes, and where start-up's
    startup: dict[str, float] = {}
    for pid, cpu in pids_at[steps].items():
        k = kinds.get(pid, "other_ray_daemons")
        step_part = (cpu - pids_at[1].get(pid, 0.0)) / (steps - 1)
        by_kind[k] = by_kind.get(k, 0.0) + step_part
        startup[k] = startup.get(k, 0.0) + pids_at[1].get(pid, 0.0) - step_part
    return {
        "samples_per_cpu_s": round(PROMPTS * GROUP / per_step, 1),
        "cpu_s_per_step": round(per_step, 2),
        "startup_cpu_s": round(at[1] - per_step, 1),
        "total_cpu_s": round(sum(seen.values()), 1),
        "cpu_s_per_step_by_process": {k: round(v, 2) for k, v in sorted(by_kind.items())},
        "startup_cpu_s_by_process": {k: round(v, 1) for k, v in sorted(startup.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    # torch threads of the TRL process. 1 by default, as each of kvrl's actors has (launch/runtime_env.yaml,
    # tests/conftest.py): on a loaded machine a second OpenMP thread spin-waits, which counts as CPU time
    ap.add_argument("--trl-threads", type=int, default=1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_trl(args.steps, Path(args.child), args.trl_threads)
    with tempfile.TemporaryDirectory() as tmp:  # interleaved: a change in the machine's load hits both
        timed = interleaved(
            {side: lambda side=side: measure(side, args.steps, Path(tmp), args.trl_threads) for side in SIDES},
            args.repeats,
        )
    runs = {
        side: [{**out, "wall_s": round(wall, 1)} for out, wall in zip(r.outs, r.wall_s)] for side, r in timed.items()
    }
    keys = ("samples_per_cpu_s", "cpu_s_per_step", "startup_cpu_s", "wall_s")
    s = {side: {k: spread([r[k] for r in rs], 2) for k in keys} for side, rs in runs.items()}
    ratios = {
        f"{key}_ratio_{side}_over_trl": round(s[side][key]["mean"] / s["trl"][key]["mean"], 3)
        for side in SIDES[:2]
        for key in ("samples_per_cpu_s", "startup_cpu_s")
    }
    emit(
        {
            "steps": args.steps,
            "repeats": args.repeats,
            "samples_per_step": PROMPTS * GROUP,
            "trl_threads": args.trl_threads,
            **{side: s[side] for side in SIDES},
            **ratios,
            "runs": runs,
        }
    )


if __name__ == "__main__":
    main()
