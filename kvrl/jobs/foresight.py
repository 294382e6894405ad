"""job=foresight: ForesightKV's pipeline, data → Golden Eviction → SFT → RL → loss ratios.

    python -m kvrl.run                       # recipe=tiny_foresight, the main job

Every stage writes under ``output_dir`` and is skipped when its output exists, so a rerun
resumes::

    traces/{train,heldout}/   full-cache traces with per-token loss and entropy (kvrl.data.traces)
    golden/ranking.pt         Golden-Eviction replays of the training traces (the stage 1 labels)
    sft/scorer.safetensors    stage 1: pairwise ranking loss (margin foresight.margin)
    rl/checkpoint.pt          stage 2: GRPO on the eviction MDP (kvrl/eviction-v0), KL to stage 1
    rl/scorer.safetensors     the final scorer; metrics.jsonl, reward.png, results.json

The pieces (replays, losses, episodes) are :mod:`kvrl.algos.foresight`. Stage 2 runs in this
process: trajectories of the eviction MDP are cheap on the tiny reasoner, and moving them
onto the shared Ray controller's rollout and learner actors is the next step for the
cluster recipes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from kvrl.algos.foresight import (RULE_BASED, collate, evaluate, evict_scores, golden_replay, loss_ratios,
                                  make_scorer, pad_stack, ranking_loss, ratio_of_sums, rl_loss, rollout,
                                  scorer_state)
from kvrl.algos.grpo import group_advantages
from kvrl.data.traces import load_traces, write_splits
from kvrl.envs.eviction import EvictionEnv
from kvrl.models.tiny import load_model
from kvrl.policies import LearnedScorer
from kvrl.runlog import RunLog, pyplot, save_torch, setup_process, write_json

SFT_WARMUP = 10  # ForesightKV's stage 1 warm-up steps before the cosine decay


def build_ranking_data(model, traces, features: LearnedScorer, path: Path) -> list[dict]:
    """Golden replays of every training trace, cached in ``path``."""
    if path.exists():
        return torch.load(path)
    data = [golden_replay(model, t, features) for t in tqdm(traces, desc="golden replays", unit="trace")]
    save_torch(data, path)
    return data


def train_sft(policy: LearnedScorer, data: list[dict], cfg, log) -> list[dict]:
    """Stage 1: Adam with 10 warm-up steps and cosine decay on the ranking loss; each step
    takes ``foresight.sft_batch_size`` traces (all their eviction steps); ``log(row)``."""
    fs = cfg.foresight
    opt = torch.optim.Adam(policy.scorer.parameters(), lr=fs.sft_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / SFT_WARMUP) * 0.5 * (
        1 + math.cos(math.pi * min(s, fs.sft_steps) / max(1, fs.sft_steps))))
    gen = torch.Generator().manual_seed(cfg.seed)
    history = []
    for step in tqdm(range(fs.sft_steps), desc="stage 1 (SFT)", unit="step"):
        picks = torch.randint(len(data), (fs.sft_batch_size,), generator=gen).tolist()
        steps = [s for i in picks for s in data[i]["steps"]]
        x = pad_stack([s["x"] for s in steps], 0.0)
        label, cand = pad_stack([s["label"] for s in steps], 0.0), pad_stack([s["candidates"] for s in steps], False)
        loss = ranking_loss(evict_scores(policy, x), label, cand, fs.margin)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        history.append({"stage": "sft", "step": step + 1, "loss": loss.item(), "lr": sched.get_last_lr()[0]})
        if (step + 1) % cfg.trainer.log_every == 0 or step + 1 == fs.sft_steps:
            log(history[-1])
    return history


def train_rl(policy: LearnedScorer, ref: LearnedScorer, env: EvictionEnv, heldout: EvictionEnv, cfg, out: Path,
             runlog: RunLog) -> list[dict]:
    """Stage 2: per step, ``trainer.batch_size / rl.group_size`` traces × ``rl.group_size``
    sampled trajectories; group-normalised advantages; one GRPO update (ForesightKV's
    single epoch without mini-batches); checkpoints every ``rl.checkpoint_every`` steps."""
    rl, tr = cfg.rl, cfg.trainer
    opt = torch.optim.AdamW(policy.scorer.parameters(), lr=tr.lr, weight_decay=tr.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, tr.warmup_steps)))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    ckpt, history, start = out / "checkpoint.pt", [], 0
    if ckpt.exists() and cfg.resume != "never":
        state = torch.load(ckpt, weights_only=False)
        policy.scorer.load_state_dict(state["scorer"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        env.load_state_dict(state["env"])
        gen.set_state(state["generator"])
        history, start = state["history"], state["step"]
        # rows a crashed run logged after this checkpoint are redone: drop them, so every step is logged once
        runlog.trim(lambda r: r["stage"] != "rl" or r["step"] <= start)
        print(f"stage 2: resumed from {ckpt} at step {start}")
    else:
        env.reset(seed=cfg.seed)
    n_traces = tr.batch_size // rl.group_size
    bar = tqdm(range(start, tr.steps), desc="stage 2 (RL)", unit="step", initial=start, total=tr.steps)
    for step in bar:
        t0 = time.perf_counter()
        # -- rollouts: G trajectories per trace, actions sampled Top-K multinomial
        episodes = []
        for _ in range(n_traces):
            trace = env.next_trace()
            episodes += [rollout(env, policy, trace, sample=True, generator=gen) for _ in range(rl.group_size)]
        rewards = torch.tensor([e.reward for e in episodes])
        advantages = group_advantages(rewards, rl.group_size, scale=rl.scale)
        # -- one GRPO update
        loss, metrics = rl_loss(policy, ref, collate(episodes), advantages, rl)
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.scorer.parameters(), tr.max_grad_norm or float("inf"))
        opt.step()
        sched.step()
        row = {"stage": "rl", "step": step + 1, "reward": rewards.mean().item(), "reward_std": rewards.std().item(),
               "loss_ratio": ratio_of_sums(episodes),
               "hurt": sum(e.info["hurt"] for e in episodes) / len(episodes), "loss": loss.item(),
               "grad_norm": float(grad_norm), "seconds": time.perf_counter() - t0, **metrics}
        if (step + 1) % tr.log_every == 0 or step + 1 == tr.steps:
            row.update({f"heldout_{k}": v for k, v in evaluate(heldout, policy, len(heldout.traces)).items()})
        history.append(row)
        bar.set_postfix(reward=f"{row['reward']:.3g}")
        runlog.log(row)
        if (rl.checkpoint_every and (step + 1) % rl.checkpoint_every == 0) or step + 1 == tr.steps:
            save_torch({"scorer": policy.scorer.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "env": env.state_dict(), "generator": gen.get_state(),
                        "history": history, "step": step + 1}, ckpt)
    return history


def plot(history: list[dict], baselines: dict, path: Path) -> None:
    """Stage 2's training reward, and the held-out loss ratio against Golden and the best rule."""
    plt = pyplot()
    rl = [h for h in history if h.get("stage") == "rl"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [h["step"] for h in rl]
    mean = torch.tensor([h["reward"] for h in rl])
    std = torch.tensor([h["reward_std"] for h in rl])
    a.plot(steps, mean, label="mean over the step's trajectories")
    a.fill_between(steps, mean - std, mean + std, alpha=0.2)
    a.set_xlabel("RL step")
    a.set_ylabel("reward  −Σ Δloss² (sampled evictions)")
    a.set_title("stage 2 training reward", fontsize=10)
    a.legend(fontsize=8)
    ev = [h for h in rl if "heldout_loss_ratio" in h]
    b.plot([0] + [h["step"] for h in ev], [baselines["sft"]] + [h["heldout_loss_ratio"] for h in ev], marker="o",
           label="Foresight (top-k)")
    for name, style in (("golden", "k--"), ("best rule-based", "r:")):
        b.axhline(baselines[name], linestyle=style[1:], color=style[0], label=name)
    b.set_yscale("log")
    b.set_xlabel("RL step (0 = after SFT)")
    b.set_ylabel("held-out loss ratio (compressed / full)")
    b.set_title("held-out loss ratio", fontsize=10)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(cfg) -> dict:
    setup_process(cfg.seed)
    out = Path(cfg.output_dir)
    started = time.perf_counter()
    runlog = RunLog(out, fresh=cfg.resume == "never")

    # ---- 1. trace data (full cache, kept when correct and long enough)
    fs, kv = cfg.foresight, cfg.kv
    splits = write_splits(cfg)
    model, _ = load_model(cfg.model.path, cfg.model.dtype, cfg.device)
    model.requires_grad_(False)
    train, heldout = load_traces(splits["train"]), load_traces(splits["heldout"])
    print(f"traces: {len(train)} train, {len(heldout)} held-out ({time.perf_counter() - started:.0f} s)")

    # ---- 2. Golden Eviction replays, 3. stage 1 (SFT)
    policy = make_scorer(model, kv)
    sft_path = out / "sft" / "scorer.safetensors"
    if sft_path.exists() and cfg.resume != "never":
        policy.scorer.load_state_dict(load_file(sft_path))
    else:
        data = build_ranking_data(model, train, policy, out / "golden" / "ranking.pt")
        runlog = RunLog(out, fresh=True)  # SFT starts over, and RL after it: so do their logs
        train_sft(policy, data, cfg, runlog.log)
        sft_path.parent.mkdir(parents=True, exist_ok=True)
        save_file(scorer_state(policy), sft_path)
    print(f"stage 1 done ({time.perf_counter() - started:.0f} s)")
    ref = make_scorer(model, kv)
    ref.scorer.load_state_dict(policy.scorer.state_dict())
    ref.scorer.requires_grad_(False)

    # ---- 4. stage 2 (RL) on the eviction MDP
    env_kwargs = dict(model=model, budget=kv.budget, interval=kv.interval, window=kv.window, sink=kv.sink,
                      eta=fs.eta, low_entropy=fs.low_entropy)
    env = EvictionEnv(train, **env_kwargs)
    held_env = EvictionEnv(heldout, shuffle=False, **env_kwargs)
    sft_eval = evaluate(held_env, policy, len(heldout))
    (out / "rl").mkdir(exist_ok=True)
    history = train_rl(policy, ref, env, held_env, cfg, out / "rl", runlog)
    save_file(scorer_state(policy), out / "rl" / "scorer.safetensors")
    print(f"stage 2 done ({time.perf_counter() - started:.0f} s)")

    # ---- 5. held-out loss ratios at the training setting, and the plots
    setting = dict(budget=kv.budget, interval=kv.interval, window=kv.window, sink=kv.sink)
    sft = make_scorer(model, kv)
    sft.scorer.load_state_dict(load_file(sft_path))
    ratios = loss_ratios(model, heldout, {"golden": "golden", "foresight_sft": sft, "foresight_rl": policy,
                                          **{n: n for n in RULE_BASED}}, **setting)
    baselines = {"sft": sft_eval["loss_ratio"], "golden": ratios["golden"],
                 "best rule-based": min(ratios[n] for n in RULE_BASED)}
    plot(history, baselines, out / "reward.png")
    result = {"setting": setting, "heldout_traces": len(heldout), "loss_ratio": ratios,
              "reward_first": history[0]["reward"] if history else None,
              "reward_last": history[-1]["reward"] if history else None,
              "minutes": (time.perf_counter() - started) / 60, "plot": str(out / "reward.png")}
    write_json(out / "results.json", result)
    runlog.close()
    print(f"\nheld-out loss ratio (Σ compressed loss / Σ full-cache loss) at budget {kv.budget}, interval "
          f"{kv.interval}, {len(heldout)} traces:")
    for name, r in sorted(ratios.items(), key=lambda kv_: kv_[1]):
        print(f"  {name:<14}{r:>14.4g}")
    print(f"plots: {out / 'reward.png'}; results: {out / 'results.json'}")
    return result
