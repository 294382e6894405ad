"""ForesightKV (seed 004; methods.md §4): learned eviction scorers, trained in two stages
with the LLM frozen.

Pipeline (job ``foresight``; every stage writes under ``output_dir`` and is skipped when
its output exists, so a rerun resumes)::

    traces/{train,heldout}/   full-cache traces with per-token loss and entropy (kvrl.data.traces)
    golden/ranking.pt         Golden-Eviction replays of the training traces: the scorer's
                              features at every eviction step, the oracle's scores, and the
                              eviction trace (death) the oracle induces
    sft/scorer.safetensors    stage 1: pairwise ranking loss (margin foresight.margin)
    rl/checkpoint.pt          stage 2: GRPO on the eviction MDP (kvrl/eviction-v0), KL to stage 1
    rl/scorer.safetensors     the final scorer; metrics.jsonl, reward.png, results.json

The scorer is :class:`kvrl.policies.LearnedScorer` (per-layer, per-KV-head MLPs on
``[k ‖ v ‖ 8·G attention features]``, hidden 16). Inference loads ``rl/scorer.safetensors``
into it and evicts deterministically (top-k) in either engine; ``VLLMEngine.push_scorer``
updates a running vLLM engine. Sampled eviction at inference stays available
(``Sampling(sample_evictions=True)``: Plackett–Luce draws of ``KVPolicy.select``); ForesightKV's
own evaluation samples by mistake (methods.md §4), kvrl's default is deterministic.

Scale note: the features of every eviction step are stored (Golden replays and stage 2
trajectories): O(steps·layers·H·(B+L)·(2D+8G)) floats per trace, small for the tiny
reasoner; :func:`kvrl.policies.golden.block_attention` materialises the T×T attention of every
layer at once, which long traces of the cluster recipes would need to do blockwise.

Action log-probability (stage 2): actions are ForesightKV's Top-K multinomial draws (E
slots without replacement from the softmax over the 2E highest-scoring candidates) and
their log-probability is that of the drawn *set*, computed exactly
(:func:`kvrl.policies.learned.topk_set_logprob`, Kool et al. 2020). Each (eviction step,
layer, KV head) decision is a "token" of the GRPO loss carrying its trajectory's advantage.
When the current scorer's pool no longer contains the drawn set, the set's probability is
0: the decision gets ratio ≈ 0 and no gradient (it cannot happen on the first update of a
batch, which is on-policy; ForesightKV takes exactly one update per batch).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from kvrl.algos.grpo import group_advantages, grpo_loss
from kvrl.data.traces import Trace, load_traces, write_splits
from kvrl.envs.eviction import ChunkedPass, EvictionEnv, run_policy
from kvrl.policies import LearnedScorer, make_policy
from kvrl.policies.golden import GoldenEviction, block_attention
from kvrl.policies.learned import topk_pool, topk_set_logprob

RULE_BASED = ("streaming", "h2o", "snapkv", "rkv", "gkv")
SFT_WARMUP = 10  # ForesightKV's stage 1 warm-up steps before the cosine decay


def make_scorer(model, kv) -> LearnedScorer:
    """The learned-scorer policy of the ``kv`` config section for ``model``."""
    return make_policy("learned", model.config, budget=kv.budget, interval=kv.interval, window=kv.window,
                       sink=kv.sink, **kv.kwargs)


def scorer_state(policy: LearnedScorer) -> dict[str, Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in policy.scorer.state_dict().items()}


def pad_stack(tensors: list[Tensor], value) -> Tensor:
    """Stack tensors of equal rank, padding every axis to the longest with ``value``
    (traces differ in their number of eviction steps and slots)."""
    shape = [max(t.shape[i] for t in tensors) for i in range(tensors[0].dim())]
    out = tensors[0].new_full((len(tensors), *shape), value)
    for i, t in enumerate(tensors):
        out[(i, *[slice(0, n) for n in t.shape])] = t
    return out


# ---- stage 0: Golden Eviction replays -> ranking data -------------------------------------------------------


@torch.no_grad()
def golden_replay(model, trace: Trace, features: LearnedScorer) -> dict:
    """Replay Golden Eviction over one trace: ``{"steps": [...], "death": ...}`` with, per
    eviction step, the scorer's features ``x`` [layers, H, N, F], the oracle's keep-scores
    ``label`` [layers, H, N] and the ``candidates`` mask (ForesightKV replays the oracle's
    drops and supervises every step), and the eviction trace the oracle induces
    (:class:`kvrl.cache.EvictionTrace` death [layers, 1, H, T])."""
    kv = dict(budget=features.budget, interval=features.interval, window=features.window, sink=features.sink)
    blocks, starts = block_attention(model, torch.tensor(trace.ids), trace.prompt_len, features.interval)
    golden = GoldenEviction(**kv, blocks=blocks, starts=starts)
    run = ChunkedPass(model, torch.tensor(trace.ids), trace.prompt_len, features)
    steps = []
    while run.advance():
        xs, labels, cands = [], [], []
        for obs in run.observations():
            x, state = features.features(obs)
            label, _ = golden.score(obs)
            candidates = (obs.key_pos >= 0) & ~features.always_kept(obs.key_pos)
            run.apply(obs.layer, golden.select(obs, label).keep, state)
            xs.append(x[0]), labels.append(label[0]), cands.append(candidates[0])
        steps.append({"x": torch.stack(xs), "label": torch.stack(labels), "candidates": torch.stack(cands)})
    return {"steps": steps, "death": run.cache.trace(torch.tensor([len(trace.ids)])).death}


def build_ranking_data(model, traces: list[Trace], features: LearnedScorer, path: Path) -> list[dict]:
    """Golden replays of every training trace, cached in ``path``."""
    if path.exists():
        return torch.load(path)
    data = [golden_replay(model, t, features) for t in tqdm(traces, desc="golden replays", unit="trace")]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return data


# ---- stage 1: SFT with the pairwise ranking loss -------------------------------------------------------------


def ranking_loss(evict: Tensor, label: Tensor, candidates: Tensor, margin: float) -> Tensor:
    """ForesightKV's pairwise hinge: for candidate pairs the oracle ranks i above j (keeps i
    rather than j), ``max(0, margin − (s_j − s_i))`` on eviction scores s; averaged over the
    pairs of each [..., N] row (a (step, layer, head)), then over rows, summed over layers.

    evict, label [S, layers, H, N]; candidates bool, same shape.
    """
    pair = candidates[..., :, None] & candidates[..., None, :] & (label[..., :, None] > label[..., None, :])
    hinge = torch.relu(margin - (evict[..., None, :] - evict[..., :, None]))  # [.., i, j]: s_j − s_i
    per_row = (hinge * pair).sum((-1, -2)) / pair.sum((-1, -2)).clamp(min=1)
    rows = pair.any(-1).any(-1)
    return ((per_row * rows).sum((0, 2)) / rows.sum((0, 2)).clamp(min=1)).sum()


def evict_scores(policy: LearnedScorer, x: Tensor) -> Tensor:
    """Eviction scores [S, layers, H, N] of features x [S, layers, H, N, F]."""
    return torch.stack([policy.scorer(layer, x[:, layer]) for layer in range(x.shape[1])], 1)


def train_sft(policy: LearnedScorer, data: list[dict], cfg, log) -> list[dict]:
    """Stage 1: Adam with 10 warm-up steps and cosine decay on the ranking loss; each step
    takes ``foresight.sft_batch_size`` traces (all their eviction steps)."""
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


# ---- stage 2: GRPO on the eviction MDP ------------------------------------------------------------------------


@dataclass
class Episode:
    """One eviction trajectory: reward and info from the environment, and per decision
    (eviction step × layer, each over H heads) what the learner needs to re-score it."""

    reward: float
    info: dict
    x: Tensor  # [D, H, N, F] features
    layer: Tensor  # [D] layer of each decision
    candidates: Tensor  # [D, H, N]
    n_evict: Tensor  # [D, H]
    drawn: Tensor  # [D, H, N]
    logprob: Tensor  # [D, H] behaviour log-probability of the drawn sets


@torch.no_grad()
def rollout(env: EvictionEnv, policy: LearnedScorer, trace: int, *, sample: bool,
            generator: torch.Generator | None = None) -> Episode:
    """Play one episode of ``env`` on ``trace`` with the scorer choosing every eviction."""
    obs, _ = env.reset(options={"trace": trace})
    record = {k: [] for k in ("x", "layer", "candidates", "n_evict", "drawn", "logprob")}
    while True:
        keeps = []
        for layer in range(obs.features.shape[0]):
            scores = -policy.scorer(layer, obs.features[layer])
            draw = policy.act(obs.key_pos[layer], scores, sample=sample, generator=generator)
            keeps.append(draw.keep)
            for k, v in (("x", obs.features[layer, 0]), ("layer", torch.tensor(layer)),
                         ("candidates", obs.candidates[layer, 0]), ("n_evict", obs.n_evict[layer, 0]),
                         ("drawn", draw.drawn[0]), ("logprob", draw.logprob[0])):
                record[k].append(v)
        obs, reward, terminated, truncated, info = env.step(torch.stack(keeps))
        if terminated or truncated:
            break
    stacked = {k: (pad_stack(v, 0.0 if k == "x" else False) if k in ("x", "candidates", "drawn") else torch.stack(v))
               for k, v in record.items()}
    return Episode(reward, info, **stacked)


def decision_logprobs(policy: LearnedScorer, ep: dict) -> tuple[Tensor, Tensor]:
    """Log-probability [D, H] of each recorded drawn set under ``policy`` (differentiable),
    and whether its pool still contains the set (else the set has probability 0)."""
    evict = torch.zeros(ep["candidates"].shape)
    for layer in ep["layer"].unique().tolist():
        rows = ep["layer"] == layer
        evict = evict.index_put((rows.nonzero()[:, 0],), policy.scorer(layer, ep["x"][rows]))
    pool = topk_pool(evict, ep["candidates"], ep["n_evict"])
    inside = ~(ep["drawn"] & ~pool).any(-1)
    return topk_set_logprob(evict, pool, ep["drawn"]), inside


def collate(episodes: list[Episode]) -> dict:
    """Episodes -> padded decision batch: x [B, D, H, N, F], masks, old logprobs [B, D·H]."""
    return {"x": pad_stack([e.x for e in episodes], 0.0),
            "layer": pad_stack([e.layer for e in episodes], 0),
            "candidates": pad_stack([e.candidates for e in episodes], False),
            "drawn": pad_stack([e.drawn for e in episodes], False),
            "n_evict": pad_stack([e.n_evict for e in episodes], 0),
            "old": pad_stack([e.logprob for e in episodes], 0.0).flatten(1)}


def rl_loss(policy: LearnedScorer, ref: LearnedScorer, batch: dict, advantages: Tensor, rl) -> tuple[Tensor, dict]:
    """The shared GRPO loss over decisions, with the k3 KL to the stage-1 scorer."""
    flat = {k: batch[k].flatten(0, 1) for k in ("x", "layer", "candidates", "drawn", "n_evict")}
    B = batch["old"].shape[0]
    logp, inside = decision_logprobs(policy, flat)
    with torch.no_grad():
        ref_logp, ref_inside = decision_logprobs(ref, flat)
    mask = (flat["n_evict"] > 0).view(B, -1)
    logp, inside, ref_logp, ref_inside = (t.view(B, -1) for t in (logp, inside, ref_logp, ref_inside))
    # A set outside the current pool has probability 0: ratio e^-50 and no gradient.
    logp = torch.where(inside, logp, batch["old"] - 50.0)
    # The k3 KL needs the reference's probability of the set; where the reference's pool
    # cannot draw it, that term is left out (zero value and gradient) rather than infinite.
    ref_logp = torch.where(ref_inside & inside, ref_logp, logp.detach())
    loss, metrics = grpo_loss(logp, batch["old"], advantages, mask, eps_low=rl.eps_low, eps_high=rl.eps_high,
                              ref_logprobs=ref_logp, beta=rl.beta, aggregation=rl.aggregation)
    metrics["pool_changed"] = float((~inside & mask).sum() / mask.sum().clamp(min=1))
    metrics["ref_outside"] = float((~ref_inside & mask).sum() / mask.sum().clamp(min=1))
    return loss, metrics


@torch.no_grad()
def evaluate(env: EvictionEnv, policy: LearnedScorer, n: int) -> dict:
    """Deterministic (top-k) episodes on the first ``n`` traces of ``env``: mean reward and
    the loss ratio Σ loss / Σ full-cache loss."""
    eps = [rollout(env, policy, i, sample=False) for i in range(min(n, len(env.traces)))]
    return {"reward": sum(e.reward for e in eps) / len(eps), "loss_ratio": ratio_of_sums(eps)}


def ratio_of_sums(episodes: list[Episode]) -> float:
    """Σ loss / Σ full-cache loss over all the episodes' generated tokens."""
    return sum(e.info["loss_sum"] for e in episodes) / max(sum(e.info["full_loss_sum"] for e in episodes), 1e-30)


def train_rl(policy: LearnedScorer, ref: LearnedScorer, env: EvictionEnv, heldout: EvictionEnv, cfg, out: Path,
             log) -> list[dict]:
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
        metrics = out.parent / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows if r["stage"] != "rl" or r["step"] <= start))
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
            trace = env._next()
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
        log(row)
        if (rl.checkpoint_every and (step + 1) % rl.checkpoint_every == 0) or step + 1 == tr.steps:
            torch.save({"scorer": policy.scorer.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "env": env.state_dict(), "generator": gen.get_state(),
                        "history": history, "step": step + 1}, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").rename(ckpt)
    return history


# ---- evaluation: loss ratios on held-out traces ---------------------------------------------------------------


@torch.no_grad()
def loss_ratios(model, traces: list[Trace], policies: dict, budget: int, interval: int, window: int,
                sink: int) -> dict[str, float]:
    """Σ loss / Σ full-cache loss over the generated tokens of ``traces`` for each policy
    (a name of :data:`RULE_BASED`, ``"golden"``, or a :class:`LearnedScorer`), all replayed
    by :func:`kvrl.envs.eviction.run_policy` at (budget, interval) — seed 004's Table 2."""
    full = sum(sum(t.loss) for t in traces)
    kv = dict(budget=budget, interval=interval, window=window, sink=sink)
    result = {}
    for name, p in policies.items():
        total = 0.0
        for t in traces:
            ids = torch.tensor(t.ids)
            if p == "golden":
                blocks, starts = block_attention(model, ids, t.prompt_len, interval)
                policy = GoldenEviction(**kv, blocks=blocks, starts=starts)
            elif isinstance(p, str):
                policy = make_policy(p, model.config, **kv)
            else:
                policy = p
            total += float(run_policy(model, ids, t.prompt_len, policy).scores()[0].sum())
        result[name] = total / full
    return result


def with_setting(policy: LearnedScorer, budget: int, interval: int) -> LearnedScorer:
    """A copy of a trained scorer policy at another (budget, interval)."""
    other = make_policy("learned", budget=budget, interval=interval, window=policy.window, sink=policy.sink,
                        group=policy.group, head_dim=policy.head_dim, layers=policy.layers, kv_heads=policy.kv_heads)
    other.scorer.load_state_dict(policy.scorer.state_dict())
    return other


def plot(history: list[dict], baselines: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


# ---- the pipeline job ------------------------------------------------------------------------------------------


def main(cfg) -> dict:
    """data → golden → SFT → RL → held-out loss ratios (``python -m kvrl.run recipe=tiny_foresight``)."""
    from kvrl.models.tiny import load_model

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if cfg.resume == "never":
        (out / "metrics.jsonl").unlink(missing_ok=True)

    def log(row):
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    # -- 1. trace data (full cache, kept when correct and long enough)
    fs, kv = cfg.foresight, cfg.kv
    splits = write_splits(cfg)
    model, _ = load_model(cfg.model.path, cfg.model.dtype, cfg.device)
    model.requires_grad_(False)
    train, heldout = load_traces(splits["train"]), load_traces(splits["heldout"])
    print(f"traces: {len(train)} train, {len(heldout)} held-out ({time.perf_counter() - started:.0f} s)")

    # -- 2. Golden Eviction replays, 3. stage 1 (SFT)
    policy = make_scorer(model, kv)
    sft_path = out / "sft" / "scorer.safetensors"
    if sft_path.exists() and cfg.resume != "never":
        policy.scorer.load_state_dict(load_file(sft_path))
    else:
        data = build_ranking_data(model, train, policy, out / "golden" / "ranking.pt")
        (out / "metrics.jsonl").unlink(missing_ok=True)  # SFT starts over, and RL after it: so do their logs
        train_sft(policy, data, cfg, log)
        sft_path.parent.mkdir(parents=True, exist_ok=True)
        save_file(scorer_state(policy), sft_path)
    print(f"stage 1 done ({time.perf_counter() - started:.0f} s)")
    ref = make_scorer(model, kv)
    ref.scorer.load_state_dict(policy.scorer.state_dict())
    ref.scorer.requires_grad_(False)

    # -- 4. stage 2 (RL) on the eviction MDP
    env_kwargs = dict(model=model, budget=kv.budget, interval=kv.interval, window=kv.window, sink=kv.sink,
                      eta=fs.eta, low_entropy=fs.low_entropy)
    env = EvictionEnv(train, **env_kwargs)
    held_env = EvictionEnv(heldout, shuffle=False, **env_kwargs)
    sft_eval = evaluate(held_env, policy, len(heldout))
    (out / "rl").mkdir(exist_ok=True)
    history = train_rl(policy, ref, env, held_env, cfg, out / "rl", log)
    save_file(scorer_state(policy), out / "rl" / "scorer.safetensors")
    print(f"stage 2 done ({time.perf_counter() - started:.0f} s)")

    # -- 5. held-out loss ratios at the training setting, and the plots
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
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\nheld-out loss ratio (Σ compressed loss / Σ full-cache loss) at budget {kv.budget}, interval "
          f"{kv.interval}, {len(heldout)} traces:")
    for name, r in sorted(ratios.items(), key=lambda kv_: kv_[1]):
        print(f"  {name:<14}{r:>14.4g}")
    print(f"plots: {out / 'reward.png'}; results: {out / 'results.json'}")
    return result
