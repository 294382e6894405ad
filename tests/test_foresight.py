"""ForesightKV: the action log-probability, the chunked eviction pass, Golden Eviction, the
eviction MDP environment, the trace data on Ray actors, both training stages and the
pipeline job (``kvrl.jobs.foresight``)."""

import itertools
import json
import math

import pytest
import torch
from batches import counts_traces

from kvrl.algos import foresight as fk
from kvrl.algos.grpo import group_advantages
from kvrl.config import load_config
from kvrl.data.traces import load_traces
from kvrl.engines.base import Sampling
from kvrl.engines.hf import HFEngine
from kvrl.envs import check_env, make
from kvrl.envs.eviction import EvictionEnv, hurt_penalty, run_policy
from kvrl.jobs import foresight as fj
from kvrl.policies import Observation, make_policy
from kvrl.policies.learned import topk_set_logprob

BUDGET, INTERVAL, WINDOW, SINK = 48, 16, 8, 4


# ---- the action log-probability -------------------------------------------------------------------------------


def ordered_draws_probability(phi: dict, pool: list, drawn: list) -> float:
    """P(drawn set) by enumeration: Σ over every order of sequential draws without
    replacement from phi_i / Σ_{remaining} phi."""
    total = 0.0
    for order in itertools.permutations(drawn):
        remaining, p = list(pool), 1.0
        for i in order:
            p *= phi[i] / sum(phi[j] for j in remaining)
            remaining.remove(i)
        total += p
    return total


@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 15.0])
def test_set_logprob_equals_enumeration(scale):
    g = torch.Generator().manual_seed(int(scale * 10))
    evict = torch.randn(9, generator=g, dtype=torch.float64) * scale
    pool = [0, 1, 3, 4, 6, 7, 8]  # slots 2 and 5 are not candidates
    pool_mask = torch.zeros(9, dtype=torch.bool)
    pool_mask[pool] = True
    phi = {i: math.exp(float(evict[i])) for i in pool}
    total = 0.0
    for drawn in itertools.combinations(pool, 3):
        mask = torch.zeros(9, dtype=torch.bool)
        mask[list(drawn)] = True
        p = math.exp(topk_set_logprob(evict, pool_mask, mask).item())
        want = ordered_draws_probability(phi, pool, list(drawn))
        assert p == pytest.approx(want, rel=1e-5, abs=1e-12)
        total += p
    assert total == pytest.approx(1.0, abs=1e-6)


def test_set_logprob_edge_cases_and_gradients():
    evict = torch.randn(3, 2, 6, requires_grad=True)
    pool = torch.ones(3, 2, 6, dtype=torch.bool)
    drawn = torch.zeros_like(pool)
    drawn[0, :, :2] = True  # a proper subset
    drawn[1, 0] = True  # the whole pool: probability 1
    pool[2, 1, 3:] = False
    drawn[2, 1, :3] = True  # the whole (smaller) pool
    lp = topk_set_logprob(evict, pool, drawn)
    assert lp[1, 0] == 0 and lp[1, 1] == 0 and lp[2, 0] == 0 and lp[2, 1] == 0  # certain / nothing drawn
    assert (lp[0] < 0).all()
    lp.sum().backward()
    assert torch.isfinite(evict.grad).all() and evict.grad[0].abs().sum() > 0


def test_set_logprob_of_a_row_does_not_depend_on_the_rows_beside_it():
    """Rows are taken in groups of like set size (one large first eviction among the interval's small ones):
    each row's log-probability and gradient are those of the row alone."""
    g = torch.Generator().manual_seed(0)
    evict = torch.randn(5, 3, 40, generator=g, requires_grad=True)
    sizes = torch.tensor([[4, 4, 17], [0, 4, 3], [9, 4, 4], [4, 1, 4], [4, 4, 12]])
    pool = torch.arange(40) < 2 * sizes[..., None]
    drawn = torch.arange(40) < sizes[..., None]
    lp = topk_set_logprob(evict, pool, drawn)
    lp.sum().backward()
    for i, j in itertools.product(range(5), range(3)):
        row = evict.detach()[i, j].clone().requires_grad_(True)
        alone = topk_set_logprob(row, pool[i, j], drawn[i, j])
        alone.backward()
        assert lp[i, j].item() == pytest.approx(alone.item(), abs=1e-6)
        assert torch.allclose(evict.grad[i, j], row.grad, atol=1e-6)


def key_positions(rows, n):
    return torch.arange(n).expand(rows, 1, n).clone()


def test_topk_multinomial_sampler_frequencies_match_logprob():
    """The sampler draws each set with the probability the log-prob claims (pool = top 2E)."""
    # 8 slots, sink 1 + window 2 protected: 5 candidates; budget 4 -> E = 4, the pool is all 5
    policy = make_policy("learned", budget=4, interval=4, window=2, sink=1, group=1, head_dim=4, layers=1, kv_heads=1)
    n, rows = 8, 20000
    keep_scores = torch.tensor([0.0, 0.3, -0.8, 1.2, -0.1, 0.5, 0.0, 0.0])
    draw = policy.act(
        key_positions(rows, n), keep_scores.expand(rows, 1, n), sample=True, generator=torch.Generator().manual_seed(0)
    )
    assert (draw.drawn.sum(-1) == 4).all() and not draw.drawn[..., [0, 6, 7]].any()
    sets, counts = torch.unique(draw.drawn[:, 0], dim=0, return_counts=True)
    assert len(sets) == 5
    for s, c in zip(sets, counts):
        row = (draw.drawn[:, 0] == s).all(-1).nonzero()[0, 0]
        p = draw.logprob[row, 0].exp().item()
        assert c.item() / rows == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / rows) + 1e-3)
    # 9 slots, budget 7 -> E = 2 of 6 candidates: the pool (top 4 eviction scores) leaves out 2
    policy.budget = 7
    n = 9
    keep_scores = torch.tensor([0.0, 2.0, -1.0, 0.5, -0.3, 3.0, 0.1, 0.0, 0.0])
    draw = policy.act(
        key_positions(rows, n), keep_scores.expand(rows, 1, n), sample=True, generator=torch.Generator().manual_seed(1)
    )
    assert not draw.drawn[..., [1, 5]].any()  # the two highest keep-scores are outside the pool
    sets, counts = torch.unique(draw.drawn[:, 0], dim=0, return_counts=True)
    assert len(sets) == 6  # C(4, 2)
    total = 0.0
    for s, c in zip(sets, counts):
        p = draw.logprob[(draw.drawn[:, 0] == s).all(-1).nonzero()[0, 0], 0].exp().item()
        assert c.item() / rows == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / rows) + 1e-3)
        total += p
    assert total == pytest.approx(1.0, abs=1e-5)


def test_deterministic_action_is_select():
    policy = make_policy("learned", budget=10, interval=4, window=3, sink=2, group=2, head_dim=4, layers=1, kv_heads=2)
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(16).expand(3, 2, 16).clone()
    pos[0, :, :2] = -1  # padding slots
    scores = torch.randn(3, 2, 16, generator=g)
    obs = Observation(None, None, None, pos, None, None, 0, 1.0)
    draw = policy.act(pos, scores, sample=False)
    assert torch.equal(draw.keep, policy.select(obs, scores).keep)
    assert (draw.logprob == 0).all()


# ---- the chunked pass, Golden Eviction and the environment (shipped tiny reasoner) ----------------------------


@pytest.fixture(scope="module")
def traces(tiny):
    """8 full-cache traces of the counts task, with their full-cache losses and entropies."""
    return counts_traces(*tiny, 8, 64)


@pytest.mark.parametrize("name", ["streaming", "rkv", "learned"])
def test_chunked_pass_equals_decoding_with_the_policy(tiny, name):
    """Teacher forcing a greedy trace in chunks evicts exactly what decoding it did, and its
    per-token losses are those of replaying the decoding's eviction trace."""
    model, tok = tiny
    engine = HFEngine(model, tok)
    env = make("kvrl/counts-v0")
    env.reset(seed=7)
    task = env.tasks(1)[0]
    policy = make_policy(name, model.config, budget=40, interval=8, window=WINDOW, sink=SINK)
    out = engine.generate([task.prompt], Sampling(max_new_tokens=64), policy=policy)
    ids = torch.tensor(out.prompt_ids[0] + out.tokens[0])
    run = run_policy(model, ids, len(out.prompt_ids[0]), policy)
    trace = run.cache.trace(torch.tensor([len(ids)]))
    assert torch.equal(trace.full(), out.trace(0).full())
    with torch.no_grad():
        replay = engine.score(out, trace=out.traces)
    torch.testing.assert_close(run.scores()[0], replay.losses[0], atol=1e-5, rtol=1e-4)


def test_golden_eviction_is_the_lower_bound(tiny, traces):
    model, _ = tiny
    policies = {"golden": "golden", **{n: n for n in fk.RULE_BASED}}
    ratios = fk.loss_ratios(model, traces, policies, budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    assert all(ratios["golden"] < ratios[n] for n in fk.RULE_BASED), ratios
    assert all(r > 1 for r in ratios.values())  # every policy loses something at this budget


def test_hurt_penalty_hand_computed():
    loss = torch.tensor([0.0, 3.0, 2.0, 5.0, 0.1])
    full = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])
    entropy = torch.tensor([0.1, 0.2, 0.3, 9.0, 0.4])  # token 3 is the high-entropy fifth
    penalty, hurt = hurt_penalty(loss, full, entropy, eta=1.5, low_entropy=0.8)
    assert hurt == 2 and penalty == pytest.approx(2.0**2 + 2.0**2)  # tokens 1 and 2 (Δ = 2 > 1.5)


def test_eviction_env_contract_and_reward(tiny, traces):
    model, _ = tiny
    env = EvictionEnv(traces, model=model, budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    check_env(env)
    # keeping everything the budget allows by position (StreamingLLM) gives the streaming losses
    obs, _ = env.reset(options={"trace": 0})
    while obs is not None:
        assert (obs.key_pos >= 0).all()  # one trace: no padding slots, slot order = position order
        n = obs.key_pos.shape[-1]
        keep = torch.cat([torch.arange(SINK), torch.arange(n - BUDGET + SINK, n)])
        obs, reward, terminated, _, info = env.step(keep.expand(*obs.key_pos.shape[:-1], BUDGET))
    streaming = make_policy("streaming", budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    want = run_policy(model, torch.tensor(traces[0].ids), traces[0].prompt_len, streaming).scores()[0].sum()
    assert terminated and info["loss_sum"] == pytest.approx(float(want), rel=1e-5)
    assert reward <= 0
    with pytest.raises(ValueError, match="sink/window"):
        obs, _ = env.reset(options={"trace": 0})
        env.step(torch.arange(BUDGET).expand(obs.key_pos.shape[:-1] + (BUDGET,)) + 0)


def test_ranking_loss_hand_computed():
    evict = torch.tensor([0.0, 0.005, 1.0]).view(1, 1, 1, 3)
    label = torch.tensor([3.0, 2.0, 1.0]).view(1, 1, 1, 3)  # keep 0 over 1 over 2
    cand = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    # pairs (0,1): 0.01 − 0.005; (0,2): 0; (1,2): 0 -> mean over 3 pairs
    assert fk.ranking_loss(evict, label, cand, 0.01).item() == pytest.approx(0.005 / 3)
    # pairs="gap" weighs them by the label gaps 1, 2, 1: only (0,1) has a hinge -> 0.005 * 1 / 4
    assert fk.ranking_loss(evict, label, cand, 0.01, "gap").item() == pytest.approx(0.005 / 4)
    # two tokens no future query reads (labels 0 and 1e-9) decide nothing: their misorder costs ~nothing under "gap"
    label = torch.tensor([3.0, 1e-9, 0.0]).view(1, 1, 1, 3)
    evict = torch.tensor([0.0, 1.0, 0.0]).view(1, 1, 1, 3)  # hinges: (0,1) 0, (0,2) 0.01, (1,2) 1.01
    assert fk.ranking_loss(evict, label, cand, 0.01).item() == pytest.approx(1.02 / 3)
    assert fk.ranking_loss(evict, label, cand, 0.01, "gap").item() == pytest.approx(0.01 * 3 / 6, rel=1e-6)


def test_sft_then_rl_stage(tiny, traces):
    """Stage 1 lowers the ranking loss; stage 2's first update is on-policy (ratio 1: the
    learner re-scores exactly the behaviour log-probabilities) and moves the scorer."""
    model, _ = tiny
    cfg = load_config(
        ["recipe=tiny_foresight", "foresight.sft_steps=40", "foresight.sft_batch_size=4", "trainer.log_every=1000"]
    )
    policy = fk.make_scorer(model, cfg.kv)
    data = [fk.golden_replay(model, t, policy) for t in traces]
    history = fj.train_sft(policy, data, cfg, log=lambda row: None)
    first, last = sum(h["loss"] for h in history[:5]) / 5, sum(h["loss"] for h in history[-5:]) / 5
    assert last < 0.7 * first, (first, last)

    env = EvictionEnv(traces, model=model, budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    g = torch.Generator().manual_seed(0)
    episodes = [fk.rollout(env, policy, i // 4, sample=True, generator=g) for i in range(8)]
    rewards = torch.tensor([e.reward for e in episodes])
    assert rewards.std() > 0  # sampled evictions differ
    adv = group_advantages(rewards, 4)
    loss, metrics, _ = fk.rl_loss(policy, policy, fk.collate(episodes), adv, cfg.rl)
    assert metrics["ratio_min"] == pytest.approx(1.0, abs=1e-4) and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["pool_changed"] == 0 and metrics["kl"] == pytest.approx(0.0, abs=1e-8)
    loss.backward()
    assert policy.scorer.w1.grad.abs().sum() > 0


def test_sft_with_gap_pairs_lowers_the_gap_loss(tiny, traces):
    """``foresight.pairs=gap`` reaches stage 1: its logged loss is the gap-weighted one (equal to
    ranking_loss(..., "gap") of the untrained scorer on the first batch), and it falls; a value that is
    neither weighting is refused naming both."""
    model, _ = tiny
    keys = ["recipe=tiny_foresight", "foresight.sft_steps=40", "foresight.sft_batch_size=4", "trainer.log_every=1000"]
    cfg = load_config([*keys, "foresight.pairs=gap"])
    policy = fk.make_scorer(model, cfg.kv)
    data = [fk.golden_replay(model, t, policy) for t in traces]
    picks = torch.randint(len(data), (4,), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    steps = [s for i in picks for s in data[i]["steps"]]
    x, label = fk.pad_stack([s["x"] for s in steps], 0.0), fk.pad_stack([s["label"] for s in steps], 0.0)
    cand = fk.pad_stack([s["candidates"] for s in steps], False)
    with torch.no_grad():
        gap, uniform = (fk.ranking_loss(fk.evict_scores(policy, x), label, cand, 0.01, p) for p in ("gap", "uniform"))
    history = fj.train_sft(policy, data, cfg, log=lambda row: None)
    assert history[0]["loss"] == pytest.approx(gap.item(), rel=1e-5) and gap.item() != pytest.approx(uniform.item())
    first, last = sum(h["loss"] for h in history[:5]) / 5, sum(h["loss"] for h in history[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    with pytest.raises(ValueError, match="'uniform' or 'gap'"):
        load_config([*keys, "foresight.pairs=rank"])


def test_traces_are_made_on_actors_and_a_lost_shard_again_alike(tmp_path, monkeypatch):
    """The data step's shards come from trace actors, none from this process; a deleted shard is
    made again, alone, by another actor (there is one missing shard, so one actor) with the
    same rows, and the finished shards are left as they were. With workers.address=inline (the
    actors in this process, Ray shut down) the shards are the same."""
    import pyarrow.parquet as pq
    import ray

    from kvrl.workers import traces as data

    def here(*args, **kwargs):
        raise AssertionError("the trace actors generate and score, not this process")

    monkeypatch.setattr(HFEngine, "generate", here)  # here only: the actors import kvrl.engines.hf afresh
    monkeypatch.setattr(HFEngine, "score", here)
    args = [
        "recipe=tiny_foresight",
        "workers.engine=hf",
        "workers.rollout=2",
        "foresight.traces=8",
        "foresight.heldout=4",
        "foresight.shard_size=4",
        "foresight.min_tokens=0",
        "sampling.batch_size=8",
        "sampling.temperature=1.0",
    ]  # sampled: the seeds must follow the shard
    cfg = load_config([*args, f"output_dir={tmp_path}"])
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024**2, log_to_driver=False
    )
    try:
        data.write_splits(cfg)  # round 1: actor 0 makes train/0, actor 1 train/1; round 2: actor 0 heldout/0
        files = sorted((tmp_path / "traces").rglob("shard-*.parquet"))
        assert [f.relative_to(tmp_path / "traces").as_posix() for f in files] == [
            "heldout/shard-00000.parquet",
            "train/shard-00000.parquet",
            "train/shard-00001.parquet",
        ]
        first = {f: pq.read_table(f) for f in files}
        made = {f: f.stat().st_mtime_ns for f in files}
        lost = tmp_path / "traces" / "train" / "shard-00001.parquet"
        lost.unlink()
        data.write_splits(cfg)
    finally:
        ray.shutdown()
    assert pq.read_table(lost).equals(first[lost])
    assert all(f.stat().st_mtime_ns == made[f] for f in files if f != lost)
    train = load_traces(tmp_path / "traces" / "train")
    assert len(train) == 8 and len({t.task_id for t in train}) == 8  # shards draw different tasks
    assert all(len(t.loss) == len(t.ids) - t.prompt_len for t in train)
    monkeypatch.undo()  # inline, this process generates
    data.write_splits(load_config([*args, f"output_dir={tmp_path / 'inline'}", "workers.address=inline"]))
    assert not ray.is_initialized()
    for f in files:
        assert pq.read_table(tmp_path / "inline" / f.relative_to(tmp_path)).equals(first[f]), f


@pytest.mark.slow
def test_pipeline_job_runs_and_resumes(tmp_path, capsys):
    from kvrl.run import main

    args = [
        "recipe=tiny_foresight",
        f"output_dir={tmp_path}",
        "workers.engine=hf",
        "foresight.traces=8",
        "foresight.heldout=4",
        "foresight.shard_size=4",
        "foresight.sft_steps=5",
        "trainer.batch_size=8",
        "rl.group_size=4",
        "trainer.log_every=2",
        "rl.checkpoint_every=1",
        "sampling.batch_size=8",
    ]
    assert main(args + ["trainer.steps=2"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["loss_ratio"]) == {"golden", "foresight_sft", "foresight_rl", *fk.RULE_BASED}
    # held-out accuracy beside the ratios: every generating policy and the full cache, with intervals
    accuracy = result["accuracy"]
    assert set(accuracy) == {"full", "foresight_sft", "foresight_rl", *fk.RULE_BASED}
    for a in accuracy.values():
        assert a["tasks"] == 4 and a["ci95"][0] <= a["accuracy"] <= a["ci95"][1]
    assert accuracy["full"]["accuracy"] >= 0.75  # the shipped reasoner, greedy, with the whole cache
    assert "greedy accuracy of 4 tasks [95 % Wilson interval]" in capsys.readouterr().out
    assert len(load_traces(tmp_path / "traces" / "train")) == 8 and (tmp_path / "reward.png").exists()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rl_rows] == [1, 2]  # stage 2 ran on the Ray controller, in rl/
    assert [r["step"] for r in rows if r["stage"] == "sft"] == [2, 4, 5]  # every trainer.log_every, and the last
    capsys.readouterr()
    # a longer run resumes from the checkpoint: only step 3 is new, the data and SFT are reused
    assert main(args + ["trainer.steps=3"]) == 0
    captured = capsys.readouterr()
    assert "resumed from" in captured.out and "golden replays" not in captured.err
    rl_rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rl_rows] == [1, 2, 3]


@pytest.mark.parametrize("recipe", ["foresight_qwen3_4b", "foresight_qwen3_1_7b", "foresight_r1_qwen_7b"])
def test_cluster_recipes_dry_run(recipe, capsys):
    from kvrl.run import main

    assert main([f"recipe={recipe}", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "KV cache" in out
    assert "2 rollout (hf" in out and "1 learner" in out  # stage 2 runs on Ray actors
    assert "traces     2 rollout actors (vllm + hf scoring" in out and "trace actor peak" in out  # and the data step


def test_config_errors_name_the_fix():
    from kvrl.config import ConfigError

    with pytest.raises(ConfigError, match="kv.policy=learned"):
        load_config(["recipe=tiny_foresight", "kv.policy=rkv"])
    with pytest.raises(ConfigError, match="trainer.batch_size="):
        load_config(["recipe=tiny_foresight", "trainer.batch_size=12"])
