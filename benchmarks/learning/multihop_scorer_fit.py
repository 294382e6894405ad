"""How well can a scorer learn Golden Eviction's choices on the multihop reasoner: capacity against features.

Takes a finished ForesightKV run (``--run``): its Golden Eviction replays of the training traces
(``golden/ranking.pt``, at the run's budget) and its held-out traces, replayed by Golden Eviction here at the same
budget. Fits, with stage 1's ranking loss and schedule (``foresight.sft_*`` of ``tiny_multihop_foresight``, the
run's seed), scorers that differ in one thing each:

* ``foresight``: ForesightKV's per-KV-head MLP (hidden 16) on ``[k ‖ v ‖ 8·G attention features]``, as shipped;
* ``wide``: the same inputs, hidden ``--wide`` (capacity);
* ``attention_only`` / ``kv_only``: the shipped MLP with the keys and values, or the attention features, zeroed;
* ``gap_pairs``: the shipped MLP fitted with ``foresight.pairs=gap`` (a pair weighs the oracle's keep-score gap).

``--variants`` fits some of them only; their line is then recorded as ``multihop_scorer_fit_<budget>_<variants>``.

Where the two weightings of stage 1's pairs put their weight (``pair_weight``: :func:`led_by_the_most_read`) is
measured on the same training replays. For each variant, and for the run's own stage-1 scorer, reports the AUC of
its score between the candidates Golden Eviction keeps and those it evicts at a step (per layer and KV head,
pooled; 1 is the oracle's own choice) on the training replays it was fitted to and on the held-out replays, and the
added NLL per generated token it causes when it evicts on its own over the held-out traces (teacher-forced;
Golden's own beside it). A scorer that fits the training replays far better than the shipped one says capacity
limits it; one that fits no better says the features do.

    python benchmarks/learning/multihop_scorer_fit.py --run outputs/multihop_foresight/seeds/b117-s0 --budget 117
"""

import argparse
import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from kvrl.algos.foresight import evict_scores, golden_replay, loss_ratios, make_scorer
from kvrl.bench import emit, record, train_commits
from kvrl.config import load_config
from kvrl.data.traces import load_traces
from kvrl.jobs.foresight import train_sft
from kvrl.models.tiny import load_model
from kvrl.policies.learned import N_FEATURES, ScorerMLP
from kvrl.runlog import setup_process

RECIPE = "tiny_multihop_foresight"


class Masked(nn.Module):
    """A scorer MLP that sees ``x * mask`` (mask [F]): the input features left out are zeros."""

    def __init__(self, inner: nn.Module, mask: torch.Tensor):
        super().__init__()
        self.inner, self.mask = inner, mask

    @property
    def w1(self) -> torch.Tensor:  # LearnedScorer.score reads the scorer's dtype and device from it
        return self.inner.w1

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.inner(layer, x * self.mask)


class Wide(ScorerMLP):
    """:class:`ScorerMLP` with ``hidden`` units instead of 16."""

    def __init__(self, layers: int, kv_heads: int, in_features: int, generator: torch.Generator, hidden: int):
        nn.Module.__init__(self)

        def uniform(*shape, fan_in):
            return nn.Parameter((torch.rand(*shape, generator=generator) * 2 - 1) / math.sqrt(fan_in))

        self.w1 = uniform(layers, kv_heads, in_features, hidden, fan_in=in_features)
        self.b1 = uniform(layers, kv_heads, hidden, fan_in=in_features)
        self.w2 = uniform(layers, kv_heads, hidden, fan_in=hidden)
        self.b2 = uniform(layers, kv_heads, fan_in=hidden)


def fit(policy, data: list[dict], cfg) -> float:
    """Stage 1 as the pipeline trains it (:func:`kvrl.jobs.foresight.train_sft`) on ``data``; the last step's loss."""
    return train_sft(policy, data, cfg, log=lambda row: None)[-1]["loss"]


@torch.no_grad()
def kept_vs_evicted(policy, replays: list[dict], keep: int) -> float:
    """AUC of the scorer's keep score between Golden's ``keep`` best-labelled candidates of each (step, layer, KV
    head) and the rest of its candidates."""
    wins = pairs = 0.0
    for replay in replays:
        for step in replay["steps"]:
            score = -evict_scores(policy, step["x"][None])[0]  # [layers, H, N]
            for row_label, row_cand, row_score in zip(
                step["label"].flatten(0, 1), step["candidates"].flatten(0, 1), score.flatten(0, 1)
            ):
                idx = row_cand.nonzero().flatten()
                if len(idx) <= keep:
                    continue
                order = row_label[idx].argsort(descending=True)
                d = row_score[idx[order[:keep]]][:, None] - row_score[idx[order[keep:]]][None, :]
                wins += float((d > 0).sum() + 0.5 * (d == 0).sum())
                pairs += d.numel()
    return round(wins / max(pairs, 1), 4)


def led_by_the_most_read(replays: list[dict]) -> dict:
    """Where stage 1's pairs weigh, over the replays' (step, layer, KV head) rows of at least 20 candidates: the
    share of the pair weight (uniform: every pair the oracle orders; gap: each by its label gap) on pairs whose
    higher-labelled token is in the row's top tenth of labels, and the share of the label mass that tenth holds."""
    led, total = {"uniform": 0.0, "gap": 0.0}, {"uniform": 0.0, "gap": 0.0}
    mass = [0.0, 0.0]
    for replay in replays:
        for step in replay["steps"]:
            for label, cand in zip(step["label"].flatten(0, 1), step["candidates"].flatten(0, 1)):
                value = label[cand]
                if len(value) < 20:
                    continue
                top = (value >= value.quantile(0.9))[:, None]
                for kind, weight in (
                    ("uniform", (value[:, None] > value[None, :]).double()),
                    ("gap", (value[:, None] - value[None, :]).clamp(min=0).double()),
                ):
                    led[kind] += float((weight * top).sum())
                    total[kind] += float(weight.sum())
                mass[0] += float(value[top[:, 0]].sum())
                mass[1] += float(value.sum())
    return {
        **{f"{kind}_pairs_led_by_top_tenth": round(led[kind] / total[kind], 4) for kind in led},
        "label_mass_of_top_tenth": round(mass[0] / mass[1], 4),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="a finished ForesightKV run (its Golden replays and traces)")
    ap.add_argument("--budget", type=int, required=True, help="the run's kv.budget (its replays' budget)")
    ap.add_argument("--heldout", type=int, default=16, help="held-out traces replayed and judged")
    ap.add_argument("--wide", type=int, default=64, help="the wide scorer's hidden units (ForesightKV's: 16)")
    ap.add_argument("--auc-traces", type=int, default=64, help="training traces the training AUC is measured on")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override (foresight.sft_*)"
    )
    ap.add_argument("--variants", default=None, help="comma-separated variants to fit (default: all)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    setup_process()  # one torch thread, denormals flushed: as every kvrl process
    run = Path(args.run)
    cfg = load_config([f"recipe={RECIPE}", f"kv.budget={args.budget}", *args.set])
    kv, fs = cfg.kv, cfg.foresight
    model, _ = load_model(cfg.model.path)
    model.requires_grad_(False)
    train = torch.load(run / "golden" / "ranking.pt")
    if {d["budget"] for d in train} != {args.budget}:
        raise SystemExit(f"{run}'s Golden replays are not at budget {args.budget}: pass the run's kv.budget")
    heldout_traces = load_traces(run / "traces" / "heldout")[: args.heldout]
    reference = make_scorer(model, kv)
    heldout = [golden_replay(model, t, reference, args.budget) for t in heldout_traces]
    keep = args.budget - kv.sink - kv.window

    dim = reference.head_dim * 2  # [k ‖ v] come first, then N_FEATURES per query head of the group
    width = dim + N_FEATURES * reference.group
    attention = torch.cat([torch.zeros(dim), torch.ones(width - dim)])
    variants = {"foresight_sft_of_the_run": None, "foresight": None, "wide": None, "attention_only": attention}
    variants["kv_only"] = 1 - attention
    variants["gap_pairs"] = None
    chosen = args.variants.split(",") if args.variants else list(variants)
    if unknown := set(chosen) - set(variants):
        raise SystemExit(
            f"--variants {args.variants}: no variant {sorted(unknown)}; the variants: {', '.join(variants)}"
        )
    variants = {name: variants[name] for name in chosen}
    setting = dict(budget=args.budget, interval=kv.interval, window=kv.window, sink=kv.sink)
    full = sum(map(sum, (t.loss for t in heldout_traces))) / sum(len(t.loss) for t in heldout_traces)
    lines = {}
    for name, mask in variants.items():
        policy = make_scorer(model, kv)
        if name == "foresight_sft_of_the_run":
            policy.load_scorer(run / "sft" / "scorer.safetensors")
            last_loss = None
        else:
            if name == "wide":
                gen = torch.Generator().manual_seed(cfg.seed)
                policy.scorer = Wide(policy.layers, policy.kv_heads, width, gen, args.wide)
            elif mask is not None:
                policy.scorer = Masked(policy.scorer, mask)
            pairs = "gap" if name == "gap_pairs" else fs.pairs
            last_loss = round(fit(policy, train, replace(cfg, foresight=replace(fs, pairs=pairs))), 5)
        ratio = loss_ratios(model, heldout_traces, {name: policy}, **setting)[name]
        lines[name] = {
            "sft_loss_last": last_loss,
            "auc_train": kept_vs_evicted(policy, train[: args.auc_traces], keep),
            "auc_heldout": kept_vs_evicted(policy, heldout, keep),
            "added_nll_per_token": round((ratio - 1) * full, 5),
        }
        print(name, lines[name], flush=True)
    golden = loss_ratios(model, heldout_traces, {"golden": "golden"}, **setting)["golden"]
    line = {
        "benchmark": "multihop_scorer_fit",
        "task": "multihop",
        "formulation": "foresight",
        "run": str(run),
        "budget": args.budget,
        "kv": setting,
        "train_traces": len(train),
        "heldout_traces": len(heldout_traces),
        "sft": {
            "steps": fs.sft_steps,
            "batch_size": fs.sft_batch_size,
            "lr": fs.sft_lr,
            "margin": fs.margin,
            "pairs": fs.pairs,
        },
        "wide_hidden": args.wide,
        "scorers": lines,
        "pair_weight": led_by_the_most_read(train[: args.auc_traces]),
        "golden_added_nll_per_token": round((golden - 1) * full, 5),
        "full_cache_nll_per_token": round(full, 6),
        "train_commits": train_commits(run),
    }
    results = f"multihop_scorer_fit_{args.budget}" + ("_" + "_".join(chosen) if args.variants else "")
    (emit if args.no_record else lambda x: record(results, x))(line)


if __name__ == "__main__":
    main()
