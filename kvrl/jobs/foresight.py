"""job=foresight: ForesightKV's pipeline, data → Golden Eviction → SFT → RL → held-out accuracy and loss ratios.

    python -m kvrl.run                       # recipe=tiny_foresight, the main job

Every stage writes under ``output_dir`` and is skipped when its output exists, so a rerun
resumes::

    traces/{train,heldout}/   full-cache traces with per-token loss and entropy (kvrl.data.traces)
    golden/ranking.pt         Golden-Eviction replays of the training traces (the stage 1 labels)
    sft/scorer.safetensors    stage 1: pairwise ranking loss (margin foresight.margin)
    rl/                       stage 2: GRPO on the eviction MDP (kvrl/eviction-v0), KL to stage 1, on
                              the shared Ray controller (rl.algo=foresight): metrics.jsonl,
                              checkpoints/, scorer.safetensors (the final scorer)
    metrics.jsonl, reward.png, results.json

The traces are generated and scored on ``workers.rollout`` Ray actors
(:mod:`kvrl.workers.traces`), stopped once the data is written; stage 2 is
:class:`kvrl.algos.foresight.ForesightRL` on the controller of every RL job: rollout actors
play the episodes (``workers.rollout``), learner actors update the scorer
(``workers.learners``), so a cluster run spreads over its nodes. Both use one Ray (started
here unless this runs under ``ray job submit``). The Golden Eviction replays, stage 1 and
the held-out evaluation run in this process: the replays' features (every eviction step's
keys and values) would only travel back here for the SFT, which trains a scorer of a few
thousand weights. The pieces (replays, losses, episodes) are :mod:`kvrl.algos.foresight`.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import ray
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kvrl.algos.foresight import (
    RULE_BASED,
    drawn_budget,
    evict_scores,
    golden_replay,
    loss_ratios,
    make_scorer,
    pad_stack,
    ranking_loss,
    scorer_state,
)
from kvrl.data.traces import SPLIT_SEEDS, load_traces
from kvrl.engines.hf import HFEngine
from kvrl.envs import make
from kvrl.envs.chat import Chat
from kvrl.eval.budgets import evaluate
from kvrl.eval.suite import wilson
from kvrl.models.tiny import load_model
from kvrl.policies import LearnedScorer, make_policy
from kvrl.runlog import OutputLock, RunLog, pyplot, save_torch, setup_process, write_json
from kvrl.workers.controller import Controller, connect
from kvrl.workers.traces import write_splits

SFT_WARMUP = 10  # ForesightKV's stage 1 warm-up steps before the cosine decay


def build_ranking_data(model, traces, features: LearnedScorer, path: Path, cfg) -> list[dict]:
    """Golden replays of every training trace, cached in ``path``: at kv.budget, or under
    ``foresight.budgets`` each at the budget its trace draws (:func:`drawn_budget`, keyed by the task id)."""
    if path.exists():
        return torch.load(path)
    data = [
        golden_replay(model, t, features, drawn_budget(cfg, len(t.ids), f"golden/{t.task_id}"))
        for t in tqdm(traces, desc="golden replays", unit="trace")
    ]
    save_torch(data, path)
    return data


def train_sft(policy: LearnedScorer, data: list[dict], cfg, log) -> list[dict]:
    """Stage 1: Adam with 10 warm-up steps and cosine decay on the ranking loss; each step
    takes ``foresight.sft_batch_size`` traces (all their eviction steps); ``log(row)``."""
    fs = cfg.foresight
    opt = torch.optim.Adam(policy.scorer.parameters(), lr=fs.sft_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / SFT_WARMUP) * 0.5 * (1 + math.cos(math.pi * min(s, fs.sft_steps) / max(1, fs.sft_steps)))
        ),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    history = []
    for step in tqdm(range(fs.sft_steps), desc="stage 1 (SFT)", unit="step"):
        picks = torch.randint(len(data), (fs.sft_batch_size,), generator=gen).tolist()
        steps = [s for i in picks for s in data[i]["steps"]]
        x = pad_stack([s["x"] for s in steps], 0.0)
        label, cand = pad_stack([s["label"] for s in steps], 0.0), pad_stack([s["candidates"] for s in steps], False)
        loss = ranking_loss(evict_scores(policy, x), label, cand, fs.margin, fs.pairs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        history.append({"stage": "sft", "step": step + 1, "loss": loss.item(), "lr": sched.get_last_lr()[0]})
        if (step + 1) % cfg.trainer.log_every == 0 or step + 1 == fs.sft_steps:
            log(history[-1])
    return history


class ForesightController(Controller):
    """The RL loop of stage 2; it leaves the trained scorer, not a copy of the frozen model."""

    def finish(self) -> None:
        state_ref, _ = self.learners[0].state.remote()
        save_file(dict(self.get(state_ref, "learner 0 (state)").cache), self.out / "scorer.safetensors")


def plot(records: list[dict], ratios: dict[str, float], path: Path) -> None:
    """Stage 2's training reward, and every policy's held-out loss ratio."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [r["step"] for r in records]
    mean = torch.tensor([r["reward_mean"] for r in records])
    std = torch.tensor([r["reward_std"] for r in records])
    a.plot(steps, mean, label="mean over the step's trajectories")
    a.fill_between(steps, mean - std, mean + std, alpha=0.2)
    a.set_xlabel("RL step")
    a.set_ylabel("reward  −Σ Δloss² (sampled evictions)")
    a.set_title("stage 2 training reward", fontsize=10)
    a.legend(fontsize=8)
    names = sorted(ratios, key=ratios.get)
    b.barh(names, [ratios[n] for n in names], color=["C2" if n.startswith("foresight") else "C0" for n in names])
    b.set_xscale("log")
    b.set_xlabel("held-out loss ratio (compressed / full), log scale")
    b.set_title("held-out loss ratio at the training setting", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def heldout_accuracy(cfg, model, tokenizer, policies: dict, setting: dict) -> dict[str, dict]:
    """Greedy accuracy (share of tasks with a positive reward, 95 % Wilson interval) of the full
    cache and of each policy (a policy, or a zoo name built at ``setting``) on the held-out
    task stream, whose first tasks gave the held-out traces: none was trained on."""
    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=cfg.seed + SPLIT_SEEDS["heldout"])
    tasks = env.tasks(cfg.foresight.heldout)
    engine = HFEngine(model, tokenizer, stop_ids=cfg.model.stop_ids or None, chat=Chat.of(cfg.env))
    out = {}
    for name, p in {"full": None, **policies}.items():
        policy = make_policy(p, model.config, **setting) if isinstance(p, str) else p
        r = evaluate(engine, env, tasks, cfg.sampling.max_new_tokens, policy=policy, desc=name)
        acc = float(np.mean([x > 0 for x in r["rewards"]]))
        out[name] = {"accuracy": acc, "ci95": wilson(acc, len(tasks)), "tasks": len(tasks)}
    return out


def main(cfg) -> dict:
    out = Path(cfg.output_dir)
    lock = OutputLock(out)  # one run per output_dir (stage 2's controller holds out/rl)
    started, own_ray = time.perf_counter(), False
    try:
        own_ray = connect(cfg)  # one Ray for the trace actors and stage 2's, not one each
        return pipeline(cfg, out, started)
    finally:
        if own_ray:
            ray.shutdown()
        lock.release()


def pipeline(cfg, out: Path, started: float) -> dict:
    setup_process(cfg.seed)
    runlog = RunLog(out, fresh=cfg.resume == "never")

    # ---- 1. trace data (full cache, kept when correct and long enough), on the trace actors
    kv = cfg.kv
    splits = write_splits(cfg)
    model, tokenizer = load_model(cfg.model.path, cfg.model.dtype, cfg.device)
    model.requires_grad_(False)
    train, heldout = load_traces(splits["train"]), load_traces(splits["heldout"])
    print(f"traces: {len(train)} train, {len(heldout)} held-out ({time.perf_counter() - started:.0f} s)")

    # ---- 2. Golden Eviction replays, 3. stage 1 (SFT)
    policy = make_scorer(model, kv)
    sft_path = out / "sft" / "scorer.safetensors"
    sft_trained = not (sft_path.exists() and cfg.resume != "never")
    if sft_trained:
        data = build_ranking_data(model, train, policy, out / "golden" / "ranking.pt", cfg)
        runlog = RunLog(out, fresh=True)  # SFT starts over, and RL after it: so do their logs
        train_sft(policy, data, cfg, runlog.log)
        sft_path.parent.mkdir(parents=True, exist_ok=True)
        save_file(scorer_state(policy), sft_path)
    print(f"stage 1 done ({time.perf_counter() - started:.0f} s)")

    # ---- 4. stage 2 (RL) on the eviction MDP, on the Ray controller
    rl_cfg = replace(
        cfg,
        output_dir=str(out / "rl"),
        rl=replace(cfg.rl, algo="foresight"),
        resume="never" if sft_trained else cfg.resume,
    )  # a new stage 1 starts stage 2 over
    # replace() builds a new Config: carry the environment's references, so no secret reaches its checkpoints
    rl_cfg.env_references = {
        key: f"{ref}/rl" if key == "output_dir" else ref
        for key, ref in cfg.env_references.items()
        if key not in ("rl.algo", "resume")
    }
    controller = ForesightController(rl_cfg)
    try:
        controller.run()
        records = controller.runlog.records()
    finally:
        controller.close()
    policy.load_scorer(out / "rl" / "scorer.safetensors")
    print(f"stage 2 done ({time.perf_counter() - started:.0f} s)")

    # ---- 5. held-out loss ratios at the training setting, and the plots
    setting = dict(budget=kv.budget, interval=kv.interval, window=kv.window, sink=kv.sink)
    sft = make_scorer(model, kv)
    sft.load_scorer(sft_path)
    ratios = loss_ratios(
        model,
        heldout,
        {"golden": "golden", "foresight_sft": sft, "foresight_rl": policy, **{n: n for n in RULE_BASED}},
        **setting,
    )
    # ---- 6. held-out accuracy under the same cache: what a user gets from the scorer
    accuracy = heldout_accuracy(
        cfg, model, tokenizer, {"foresight_sft": sft, "foresight_rl": policy, **{n: n for n in RULE_BASED}}, setting
    )
    plot(records, ratios, out / "reward.png")
    result = {
        "setting": setting,
        "heldout_traces": len(heldout),
        "loss_ratio": ratios,
        "accuracy": accuracy,
        "reward_first": records[0]["reward_mean"] if records else None,
        "reward_last": records[-1]["reward_mean"] if records else None,
        "minutes": (time.perf_counter() - started) / 60,
        "plot": str(out / "reward.png"),
    }
    write_json(out / "results.json", result)
    runlog.close()
    n = next(iter(accuracy.values()))["tasks"]
    print(
        f"\nheld-out tasks at budget {kv.budget} (interval {kv.interval}, window {kv.window}, sink {kv.sink}): "
        f"greedy accuracy of {n} tasks [95 % Wilson interval], and the loss ratio (Σ compressed loss / "
        f"Σ full-cache loss over {len(heldout)} held-out traces; Golden Eviction is an oracle: no accuracy)"
    )
    for name in sorted({*accuracy, *ratios}, key=lambda x: (-accuracy.get(x, {"accuracy": -1})["accuracy"], x)):
        a = accuracy.get(name)
        acc = f"{a['accuracy']:.3f} [{a['ci95'][0]:.2f}, {a['ci95'][1]:.2f}]" if a else "-"
        ratio = f"{ratios[name]:.4g}" if name in ratios else "-"
        print(f"  {name:<14}{acc:>20}{ratio:>14}")
    print(f"plots: {out / 'reward.png'}; results: {out / 'results.json'}")
    return result
