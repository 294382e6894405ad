"""One ForesightKV scorer for every budget (``foresight.budgets``): the Golden replays and the GRPO groups
draw their budgets within the range, every episode evicts down to its own budget and the learner
re-scores its drawn sets at that budget, and the range is checked with its fix."""

import json
import re

import pytest
import torch
from batches import counts_traces

from kvrl.algos import foresight as fk
from kvrl.algos.grpo import group_advantages
from kvrl.config import ConfigError, load_config
from kvrl.envs import Task
from kvrl.envs.eviction import EvictionEnv
from kvrl.jobs import foresight as fj
from kvrl.policies.regime import as_regime

BUDGET, INTERVAL, WINDOW, SINK = 48, 16, 8, 4  # tiny_foresight's kv section
GENERAL = ["recipe=tiny_foresight", "foresight.budgets=[0.3,0.7]"]


@pytest.fixture(scope="module")
def traces(tiny):
    """4 full-cache traces of the counts task long enough to evict at 30-70 % of their length."""
    made = counts_traces(*tiny, 4, 128)
    assert all(len(t.ids) > 100 for t in made), [len(t.ids) for t in made]
    return made


def env_of(model, traces):
    return EvictionEnv(traces, model=model, budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)


def test_drawn_budgets_spread_over_the_range_and_repeat():
    cfg = load_config(GENERAL)
    budgets = [fk.drawn_budget(cfg, 400, f"0/{t}") for t in range(200)]
    assert all(120 <= b <= 280 for b in budgets), budgets  # 30-70 % of 400 tokens
    assert min(budgets) < 140 and max(budgets) > 260, (min(budgets), max(budgets))
    assert budgets == [fk.drawn_budget(cfg, 400, f"0/{t}") for t in range(200)]  # the key alone draws it
    # a range that would not evict on a short trace is kept where it does: below length - interval
    assert fk.drawn_budget(load_config(["recipe=tiny_foresight", "foresight.budgets=[0.9,0.95]"]), 100, "x") == 83
    assert fk.drawn_budget(load_config(["recipe=tiny_foresight"]), 400, "0/0") is None  # off: kv.budget


def test_episodes_evict_to_their_own_budgets(tiny, traces):
    """Two episodes of one trace at two budgets: each evicts every step down to its own K (n_evict =
    cached − K slots drawn), whatever budget the policy and the env were built at; a budget that cannot
    evict is refused by name."""
    model, _ = tiny
    env, policy = env_of(model, traces), fk.make_scorer(model, load_config(GENERAL).kv)
    g = torch.Generator().manual_seed(0)
    for budget in (32, 72):
        ep = fk.rollout(env, policy, 0, sample=True, generator=g, budget=budget)
        assert ep.budget == budget and ep.info["budget"] == budget
        cached = ep.candidates.sum(-1) + WINDOW + SINK
        assert (ep.n_evict == cached - budget).all() and (ep.drawn.sum(-1) == ep.n_evict).all()
    assert fk.rollout(env, policy, 0, sample=False).budget == BUDGET  # no budget given: the env's
    with pytest.raises(ValueError, match="options budget=12 .* at least window \\+ sink \\+ 1 = 13"):
        env.reset(options={"trace": 0, "budget": 12})
    with pytest.raises(ValueError, match="below the trace's length − interval"):
        env.reset(options={"trace": 0, "budget": len(traces[0].ids) - INTERVAL})


def test_groups_share_a_drawn_budget_and_the_learner_rescores_each_at_it(tiny, traces, tmp_path):
    """ForesightRL's shard of 4 groups of 2: the episodes of a group share the budget their group's id
    draws, the groups' budgets differ, and the first update is on-policy (ratio 1, no drawn set outside
    its pool): the learner's log-probabilities of the collated batch are those of each episode's budget."""
    model, _ = tiny
    cfg = load_config([*GENERAL, f"output_dir={tmp_path / 'rl'}"])
    algo, policy = fk.ForesightRL(cfg), fk.make_scorer(model, cfg.kv)
    ids = [f"3/{t}/{d}" for t in range(4) for d in range(2)]
    tasks = [Task(f"trace-{t}", "", None, {"trace": t}) for t in range(4) for _ in range(2)]
    samples, _ = algo.generate(None, as_regime(policy), env_of(model, traces), ids, tasks, 0, 0)
    budgets = [s.data.budget for s in samples]
    want = [fk.drawn_budget(cfg, len(traces[t].ids), f"3/{t}") for t in range(4)]
    assert budgets == [b for b in want for _ in range(2)] and len(set(want)) == 4, (budgets, want)
    for s in samples:
        assert (s.data.n_evict == s.data.candidates.sum(-1) + WINDOW + SINK - s.data.budget).all()
    for s, a in zip(samples, group_advantages(torch.tensor([s.reward for s in samples]), 2).tolist()):
        s.advantage = a
    batch = algo.collate(samples, float(len(samples)), "cpu")
    _, metrics, _ = fk.rl_loss(policy, policy, batch.data, batch.advantages, cfg.rl)
    assert metrics["ratio_min"] == pytest.approx(1.0, abs=1e-4) and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["pool_changed"] == 0


def test_golden_labels_are_made_at_each_trace_s_drawn_budget(tiny, traces, tmp_path):
    """Stage 1's replays under foresight.budgets: each trace's Golden Eviction keeps the budget its task id
    draws (every step after the first sees that budget plus one interval of new tokens); off, kv.budget."""
    model, _ = tiny
    cfg = load_config(GENERAL)
    data = fj.build_ranking_data(model, traces, fk.make_scorer(model, cfg.kv), tmp_path / "ranking.pt", cfg)
    budgets = [d["budget"] for d in data]
    assert budgets == [fk.drawn_budget(cfg, len(t.ids), f"golden/{t.task_id}") for t in traces]
    assert len(set(budgets)) > 1, budgets
    for d, t in zip(data, traces):
        assert 0.3 * len(t.ids) - 1 <= d["budget"] <= 0.7 * len(t.ids) + 1
        for step in d["steps"][1:]:
            assert (step["candidates"].sum(-1) == d["budget"] + INTERVAL - WINDOW - SINK).all()
    fixed = load_config(["recipe=tiny_foresight"])
    off = fj.build_ranking_data(model, traces[:1], fk.make_scorer(model, fixed.kv), tmp_path / "fixed.pt", fixed)
    assert off[0]["budget"] == BUDGET


@pytest.mark.parametrize(
    "value, fix",
    [("[0.8,0.2]", "[0.2,0.8]"), ("[117,352]", "[0.25,0.75]"), ("[0.3]", "[0.25,0.75]"), ("[0.2,1.0]", "[0.25,0.75]")],
)
def test_a_bad_budget_range_is_refused_with_the_fix(value, fix, capsys):
    from kvrl.run import main

    with pytest.raises(ConfigError, match=re.escape(f"set foresight.budgets={fix}")):
        load_config([*GENERAL, f"foresight.budgets={value}"])
    assert main(["recipe=tiny_multihop_foresight_general", f"foresight.budgets={value}"]) == 2
    assert f"set foresight.budgets={fix}" in capsys.readouterr().err


def test_the_general_recipe_is_the_multihop_recipe_with_the_range_on():
    """benchmarks/learning/multihop_foresight.py sets the one scorer against the budget-specific ones: any
    other difference than the range would be part of that comparison."""
    general = load_config(["recipe=tiny_multihop_foresight_general"])
    specific = load_config(["recipe=tiny_multihop_foresight"])
    assert general.foresight.budgets == [0.15, 0.6] and specific.foresight.budgets is None
    general.foresight.budgets = None
    for section in ("seed", "model", "env", "kv", "sampling", "workers", "foresight", "trainer", "rl"):
        assert getattr(general, section) == getattr(specific, section), section


@pytest.mark.slow
def test_the_general_recipe_runs_through_the_pipeline(tmp_path):
    """tiny_multihop_foresight_general, shrunk to 8 traces, through the whole pipeline: the Golden replays
    and stage 2's groups draw budgets within 15-60 % of their traces, not kv.budget."""
    from kvrl.data.traces import load_traces
    from kvrl.run import main

    args = [
        "recipe=tiny_multihop_foresight_general",
        f"output_dir={tmp_path}",
        "foresight.traces=8",
        "foresight.heldout=4",
        "foresight.shard_size=4",
        "foresight.sft_steps=4",
        "foresight.sft_batch_size=4",
        "trainer.steps=2",
        "trainer.batch_size=8",
        "rl.group_size=4",
        "sampling.batch_size=8",
    ]
    assert main(args) == 0
    lengths = [len(t.ids) for t in load_traces(tmp_path / "traces" / "train")]
    budgets = [d["budget"] for d in torch.load(tmp_path / "golden" / "ranking.pt")]
    assert len(set(budgets)) > 1 and all(0.15 * n - 1 <= b <= 0.6 * n + 1 for b, n in zip(budgets, lengths)), budgets
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    means = [r["env/budget"] for r in rows]  # each step's mean over its two groups' budgets
    assert (
        len(means) == 2
        and means != [235.0, 235.0]
        and all(0.15 * min(lengths) <= m <= 0.6 * max(lengths) for m in means)
    )
