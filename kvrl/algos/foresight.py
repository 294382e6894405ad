"""ForesightKV (Dong et al. 2026, arXiv 2602.03203): learned eviction scorers, trained in two stages
with the LLM frozen — the pieces; the pipeline that runs them is ``kvrl/jobs/foresight.py``.

* Golden Eviction replays (:func:`golden_replay`): the scorer's features at every eviction
  step of a trace, the oracle's keep-scores and the eviction trace the oracle induces;
* stage 1 loss (:func:`ranking_loss`): the pairwise ranking hinge on those labels;
* stage 2 (:func:`rollout`, :func:`collate`, :func:`rl_loss`): episodes of the eviction MDP
  (``kvrl/eviction-v0``) and the GRPO loss over their decisions with the KL to stage 1;
* evaluation (:func:`evaluate`, :func:`loss_ratios`): held-out loss ratios;
* one scorer for every budget (``foresight.budgets: [lo, hi]``; off: every replay and episode at
  kv.budget): each Golden replay and each GRPO group draws its budget, a fraction of its trace's
  length (:func:`drawn_budget`). The scorer's input holds no budget (its ranking is the same whatever
  K is kept; the budget only sets how many slots go), so it serves any budget untrained;
* :class:`ForesightRL` (``rl.algo=foresight``): stage 2 as an algorithm of the shared Ray
  loop, episodes played on the rollout actors and the scorer trained on the learners.

The scorer is :class:`kvrl.policies.LearnedScorer` (per-layer, per-KV-head MLPs on
``[k ‖ v ‖ 8·G attention features]``, hidden 16). Inference loads ``rl/scorer.safetensors``
into it and evicts deterministically (top-k) in either engine; ``VLLMEngine.push_cache_state``
updates a running vLLM engine. Sampled eviction at inference stays available
(``Sampling(sample_evictions=True)``: Plackett–Luce draws of ``KVPolicy.select``); ForesightKV's
own evaluation samples (docs/fidelity.md); kvrl's default is deterministic.

Scale note: the features of every eviction step are stored (Golden replays and stage 2
trajectories): O(steps·layers·H·(B+L)·(2D+8G)) floats per trace, small for the tiny
reasoner; the Golden oracle (:func:`kvrl.policies.golden.record_attention`) keeps O(T) per
layer (queries, keys, log-sum-exps; no T×T attention map) and scores each eviction step's
cached keys against the future queries chunk by chunk.

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

import copy
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kvrl.algos.base import Algorithm, Batch, Sample
from kvrl.algos.grpo import grpo_loss
from kvrl.algos.push import Push
from kvrl.data.traces import Trace, load_traces
from kvrl.engines.base import Scores
from kvrl.envs import Task, TextEnv
from kvrl.envs.eviction import ChunkedPass, EvictionEnv, run_policy
from kvrl.policies import RULE_BASED, LearnedScorer, make_policy  # noqa: F401 (RULE_BASED: re-exported)
from kvrl.policies.golden import GoldenEviction, record_attention
from kvrl.policies.learned import topk_pool, topk_set_logprob


def make_scorer(model, kv) -> LearnedScorer:
    """The learned-scorer policy of the ``kv`` config section for ``model``."""
    return make_policy(
        "learned", model.config, budget=kv.budget, interval=kv.interval, window=kv.window, sink=kv.sink, **kv.kwargs
    )


def drawn_budget(cfg, length: int, key: str) -> int | None:
    """The budget of one Golden replay or one GRPO group's episodes under ``foresight.budgets`` = [lo, hi]:
    None when the key is unset (every replay and episode at kv.budget); else ⌊f·length⌉ tokens for a fraction f
    drawn uniformly from [lo, hi] by the run's seed and ``key`` alone (a trace's or a group's id: the same
    draw whichever process makes it), kept where it evicts: at least kv.window + kv.sink + 1 and below the
    trace's ``length`` − kv.interval."""
    if cfg.foresight.budgets is None:
        return None
    lo, hi = cfg.foresight.budgets
    digest = hashlib.sha256(f"{cfg.seed}/budget/{key}".encode()).digest()
    fraction = lo + (hi - lo) * int.from_bytes(digest[:8], "little") / 2**64
    kv = cfg.kv
    return max(kv.window + kv.sink + 1, min(round(fraction * length), length - kv.interval - 1))


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
def golden_replay(model, trace: Trace, features: LearnedScorer, budget: int | None = None) -> dict:
    """Replay Golden Eviction over one trace at ``budget`` tokens (None: ``features.budget``):
    ``{"steps": [...], "death": ..., "budget": ...}`` with, per
    eviction step, the scorer's features ``x`` [layers, H, N, F], the oracle's keep-scores
    ``label`` [layers, H, N] and the ``candidates`` mask (ForesightKV replays the oracle's
    drops and supervises every step), the eviction trace the oracle induces
    (:class:`kvrl.cache.EvictionTrace` death [layers, 1, H, T]) and the budget replayed."""
    features = features if budget is None else features.at_budget(budget)
    kv = dict(budget=features.budget, interval=features.interval, window=features.window, sink=features.sink)
    attention = record_attention(model, torch.tensor(trace.ids), trace.prompt_len, features.interval)
    golden = GoldenEviction(**kv, attention=attention)
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
    return {"steps": steps, "death": run.cache.trace(torch.tensor([len(trace.ids)])).death, "budget": kv["budget"]}


# ---- stage 1: SFT with the pairwise ranking loss -------------------------------------------------------------


def ranking_loss(evict: Tensor, label: Tensor, candidates: Tensor, margin: float, pairs: str = "uniform") -> Tensor:
    """ForesightKV's pairwise hinge: for candidate pairs the oracle ranks i above j (keeps i
    rather than j), ``max(0, margin − (s_j − s_i))`` on eviction scores s; averaged over the
    pairs of each [..., N] row (a (step, layer, head)), then over rows, summed over layers.

    ``pairs="uniform"`` weighs every ordered pair alike (ForesightKV's); ``"gap"`` weighs a pair by
    the oracle's keep-score difference ``label_i − label_j``, so two tokens whose future attention
    differs by noise weigh ~0 and the pairs the most-read tokens lead weigh most.

    evict, label [S, layers, H, N]; candidates bool, same shape.
    """
    pair = candidates[..., :, None] & candidates[..., None, :] & (label[..., :, None] > label[..., None, :])
    hinge = torch.relu(margin - (evict[..., None, :] - evict[..., :, None]))  # [.., i, j]: s_j − s_i
    weight = (label[..., :, None] - label[..., None, :]) * pair if pairs == "gap" else pair.to(hinge.dtype)
    per_row = (hinge * weight).sum((-1, -2)) / weight.sum((-1, -2)).clamp(min=torch.finfo(hinge.dtype).tiny)
    rows = pair.any(-1).any(-1)
    return ((per_row * rows).sum((0, 2)) / rows.sum((0, 2)).clamp(min=1)).sum()


def evict_scores(policy: LearnedScorer, x: Tensor) -> Tensor:
    """Eviction scores [S, layers, H, N] of features x [S, layers, H, N, F]."""
    return torch.stack([policy.scorer(layer, x[:, layer]) for layer in range(x.shape[1])], 1)


# ---- stage 2: GRPO on the eviction MDP ------------------------------------------------------------------------


@dataclass
class Episode:
    """One eviction trajectory: reward and info from the environment, the budget it evicted down to
    (its n_evict carry it to the learner: every drawn set is re-scored with its own size), and per
    decision (eviction step × layer, each over H heads) what the learner needs to re-score it."""

    reward: float
    info: dict
    budget: int
    x: Tensor  # [D, H, N, F] features
    layer: Tensor  # [D] layer of each decision
    candidates: Tensor  # [D, H, N]
    n_evict: Tensor  # [D, H]
    drawn: Tensor  # [D, H, N]
    logprob: Tensor  # [D, H] behaviour log-probability of the drawn sets


@torch.no_grad()
def rollout(
    env: EvictionEnv,
    policy: LearnedScorer,
    trace: int,
    *,
    sample: bool,
    generator: torch.Generator | None = None,
    budget: int | None = None,
) -> Episode:
    """Play one episode of ``env`` on ``trace`` at ``budget`` tokens (None: the env's) with the scorer
    choosing every eviction."""
    obs, _ = env.reset(options={"trace": trace, "budget": budget})
    actor = policy.at_budget(obs.budget)  # the episode's K slots kept, whatever budget the policy was built at
    record = {k: [] for k in ("x", "layer", "candidates", "n_evict", "drawn", "logprob")}
    while True:
        keeps = []
        for layer in range(obs.features.shape[0]):
            scores = -policy.scorer(layer, obs.features[layer])
            draw = actor.act(obs.key_pos[layer], scores, sample=sample, generator=generator)
            keeps.append(draw.keep)
            for k, v in (
                ("x", obs.features[layer, 0]),
                ("layer", torch.tensor(layer)),
                ("candidates", obs.candidates[layer, 0]),
                ("n_evict", obs.n_evict[layer, 0]),
                ("drawn", draw.drawn[0]),
                ("logprob", draw.logprob[0]),
            ):
                record[k].append(v)
        obs, reward, terminated, truncated, info = env.step(torch.stack(keeps))
        if terminated or truncated:
            break
    stacked = {
        k: (pad_stack(v, 0.0 if k == "x" else False) if k in ("x", "candidates", "drawn") else torch.stack(v))
        for k, v in record.items()
    }
    return Episode(reward, info, actor.budget, **stacked)


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
    return {
        "x": pad_stack([e.x for e in episodes], 0.0),
        "layer": pad_stack([e.layer for e in episodes], 0),
        "candidates": pad_stack([e.candidates for e in episodes], False),
        "drawn": pad_stack([e.drawn for e in episodes], False),
        "n_evict": pad_stack([e.n_evict for e in episodes], 0),
        "old": pad_stack([e.logprob for e in episodes], 0.0).flatten(1),
    }


def rl_loss(
    policy: LearnedScorer, ref: LearnedScorer, batch: dict, advantages: Tensor, rl, num_items: float | None = None
) -> tuple[Tensor, dict, Tensor]:
    """The shared GRPO loss over decisions, with the k3 KL to the stage-1 scorer; its metrics;
    and the decisions' log-probabilities under ``policy`` [B, D·H] (differentiable)."""
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
    loss, metrics = grpo_loss(
        logp,
        batch["old"],
        advantages,
        mask,
        eps_low=rl.eps_low,
        eps_high=rl.eps_high,
        ref_logprobs=ref_logp,
        beta=rl.kl_coef,
        aggregation=rl.aggregation,
        num_items=num_items,
    )
    metrics["pool_changed"] = float((~inside & mask).sum() / mask.sum().clamp(min=1))
    metrics["ref_outside"] = float((~ref_inside & mask).sum() / mask.sum().clamp(min=1))
    return loss, metrics, logp


@torch.no_grad()
def evaluate(env: EvictionEnv, policy: LearnedScorer, n: int) -> dict:
    """Deterministic (top-k) episodes on the first ``n`` traces of ``env``: mean reward and
    the loss ratio Σ loss / Σ full-cache loss."""
    eps = [rollout(env, policy, i, sample=False) for i in range(min(n, len(env.traces)))]
    return {"reward": sum(e.reward for e in eps) / len(eps), "loss_ratio": ratio_of_sums(eps)}


def ratio_of_sums(episodes: list[Episode]) -> float:
    """Σ loss / Σ full-cache loss over all the episodes' generated tokens."""
    return sum(e.info["loss_sum"] for e in episodes) / max(sum(e.info["full_loss_sum"] for e in episodes), 1e-30)


# ---- evaluation: loss ratios on held-out traces ---------------------------------------------------------------


@torch.no_grad()
def loss_ratios(
    model, traces: list[Trace], policies: dict, budget: int, interval: int, window: int, sink: int
) -> dict[str, float]:
    """Σ loss / Σ full-cache loss over the generated tokens of ``traces`` for each policy
    (a name of :data:`RULE_BASED`, ``"golden"``, or a :class:`LearnedScorer`), all replayed
    by :func:`kvrl.envs.eviction.run_policy` at (budget, interval) — ForesightKV's Table 2."""
    full = sum(sum(t.loss) for t in traces)
    kv = dict(budget=budget, interval=interval, window=window, sink=sink)
    result = {}
    for name, p in policies.items():
        total = 0.0
        for t in traces:
            ids = torch.tensor(t.ids)
            if p == "golden":
                policy = GoldenEviction(**kv, attention=record_attention(model, ids, t.prompt_len, interval))
            elif isinstance(p, str):
                policy = make_policy(p, model.config, **kv)
            else:
                policy = p
            total += float(run_policy(model, ids, t.prompt_len, policy).scores()[0].sum())
        result[name] = total / full
    return result


# ---- stage 2 on the shared loop ---------------------------------------------------------------


class ForesightRL(Algorithm):
    """ForesightKV's stage 2 as ``rl.algo=foresight`` on the shared Ray controller.

    ``job=foresight`` runs it after stage 1 with ``output_dir=<run>/rl``; it reads the
    training traces from ``<run>/traces/train`` and starts from the stage-1 scorer
    ``<run>/sft/scorer.safetensors``, which is also the KL reference.

    * tasks: the training traces, shuffled per epoch (``Task.meta["trace"]``), drawn by
      the controller; ``trainer.batch_size / rl.group_size`` traces per step;
    * rollouts (rollout actors, on the HF engine's model: an episode is a teacher-forced
      chunked pass): one episode of :class:`~kvrl.envs.eviction.EvictionEnv` per sample,
      evictions drawn Top-K multinomially from the pushed scorer, the reward the MDP's;
    * learner: the GRPO loss over decisions with the k3 KL to the stage-1 scorer
      (:func:`rl_loss`); the train/inference mismatch is that of the drawn sets'
      log-probabilities; the push is the scorer's state (``Push(cache=...)``).
    """

    rollout_engine = "hf"

    def __init__(self, cfg):
        super().__init__(cfg)
        run = Path(cfg.output_dir).parent
        self.traces, self.sft = run / "traces" / "train", run / "sft" / "scorer.safetensors"
        self.policy = self.ref = None  # the scorer being trained and the stage-1 reference, on learners

    def make_env(self, model=None):
        traces = load_traces(self.traces)
        if model is None:  # the controller: the task stream only
            return TextEnv([Task(f"trace-{i}", "", None, {"trace": i}) for i in range(len(traces))])
        kv, fs = self.cfg.kv, self.cfg.foresight
        return EvictionEnv(
            traces,
            model,
            budget=kv.budget,
            interval=kv.interval,
            window=kv.window,
            sink=kv.sink,
            eta=fs.eta,
            low_entropy=fs.low_entropy,
        )

    def rollout_policy(self, model) -> LearnedScorer:
        return make_scorer(model, self.cfg.kv)

    def generate(self, engine, regime, env, ids, tasks, seed, version):
        """A shard: one scored episode per (id, task), in order. Each episode draws its evictions from
        its own generator, seeded by the run's seed and the sample's id alone (not by the shard's
        ``seed`` and the episode's place in the shard): a sample draws the same evictions whichever
        actor plays it, in whichever shard, however many rollout workers the run has, Ray or inline.
        Under ``foresight.budgets`` a GRPO group (the id's step/task) draws one budget for its episodes
        (:func:`drawn_budget`): the group's advantages then compare evictions, not budgets."""
        samples, start = [], time.perf_counter()
        for sid, task in zip(ids, tasks):
            draws = hashlib.sha256(f"{self.cfg.seed}/{sid}".encode()).digest()  # id: step/task/draw
            generator = torch.Generator().manual_seed(int.from_bytes(draws[:8], "little") >> 1)
            trace = task.meta["trace"]
            budget = drawn_budget(self.cfg, len(env.traces[trace].ids), sid.rpartition("/")[0])
            ep = rollout(env, regime.policy, trace, sample=True, generator=generator, budget=budget)
            samples.append(
                Sample(
                    id=sid,
                    prompt_ids=[],
                    tokens=[],
                    logprobs=ep.logprob.flatten().tolist(),
                    finish_reason="stop",
                    text="",
                    version=version,
                    reward=ep.reward,
                    info=ep.info,
                    data=ep,
                )
            )
        return samples, {"tokens": 0, "seconds": time.perf_counter() - start}

    def size(self, sample) -> tuple[int, ...]:
        """An episode is padded along its decisions and each decision's candidates (:func:`collate`)."""
        return (sample.data.x.shape[0], sample.data.x.shape[2])

    def collate(self, samples, num_items, device) -> Batch:
        decisions = {k: v.to(device) for k, v in collate([s.data for s in samples]).items()}
        return Batch(
            sequences=[],
            prompt_lens=[],
            old_logprobs=decisions["old"],
            mask=(decisions["n_evict"] > 0).flatten(1).float(),
            advantages=torch.tensor([s.advantage for s in samples], device=device),
            rewards=torch.tensor([s.reward for s in samples], device=device),
            trace=None,
            num_items=num_items,
            data=decisions,
        )

    def setup(self, model, tokenizer) -> list[torch.nn.Parameter]:
        from safetensors.torch import load_file

        self.policy = make_scorer(model, self.cfg.kv)
        self.policy.scorer.load_state_dict(load_file(self.sft))
        self.ref = copy.deepcopy(self.policy)
        self.ref.scorer.requires_grad_(False)
        return list(self.policy.scorer.parameters())

    def loss(self, engine, batch):
        loss, metrics, logp = rl_loss(
            self.policy, self.ref, batch.data, batch.advantages, self.cfg.rl, num_items=batch.num_items
        )
        scores = Scores(logp, -logp, torch.zeros_like(logp), batch.mask)
        return loss, scores, metrics

    def state(self, model) -> Push:
        return Push(cache=scorer_state(self.policy))

    def load(self, model, state: Push) -> None:
        self.policy.scorer.load_state_dict(dict(state))
