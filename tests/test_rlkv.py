"""RLKV (kvrl.algos.rlkv): penalty, learner attention, gradients, export, data step, recipes."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from batches import rollout_samples
from transformers import DynamicCache

from kvrl.algos.base import collate
from kvrl.algos.rlkv import RLKV, adaptive_penalty
from kvrl.config import ConfigError, load_config
from kvrl.data.self_distill import SelfDistilledEnv, bucket_of, select
from kvrl.engines.base import Sampling
from kvrl.envs import Task, TextEnv
from kvrl.policies import Mixed
from kvrl.policies.heads import HeadAllocation, export_gates, head_allocation, load_gates, ranking

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_RECIPES = ["rlkv_r1_llama_8b", "rlkv_r1_qwen_7b", "rlkv_qwen3_4b_thinking"]


# ---- the adaptive penalty ---------------------------------------------------------------------


@pytest.mark.parametrize("mean_reward", [0.0, 0.3, 0.5])
def test_penalty_is_zero_at_or_below_tau(mean_reward):
    gates = torch.nn.Parameter(torch.rand(4, 2))
    penalty = adaptive_penalty(gates, mean_reward, beta=1e-3, tau=0.5)
    penalty.backward() if penalty.requires_grad else None
    assert penalty.item() == 0.0
    assert gates.grad is None or torch.count_nonzero(gates.grad) == 0


@pytest.mark.parametrize("mean_reward,beta,tau", [(0.51, 1e-3, 0.5), (0.75, 2.5e-3, 0.5), (1.0, 1e-3, 0.55)])
def test_penalty_matches_the_formula_above_tau(mean_reward, beta, tau):
    g = torch.tensor([[0.9, 0.0], [0.25, 1.0], [0.5, 0.7], [0.1, 0.3]])
    gates = torch.nn.Parameter(g.clone())
    penalty = adaptive_penalty(gates, torch.tensor(mean_reward), beta=beta, tau=tau)
    weight = beta * (math.exp(mean_reward) - 1)
    assert penalty.item() == pytest.approx(weight * g.abs().mean().item(), rel=1e-6)
    penalty.backward()
    # d/dα of weight·mean|α| = weight·sign(α)/N (sign(0) = 0: a closed gate is not pushed further)
    torch.testing.assert_close(gates.grad, weight * torch.sign(g) / g.numel())


# ---- the learner's mixed attention ------------------------------------------------------------


def sequences(engine, n=5, seed=0):
    """Prompts of different lengths with random continuations (a padded batch)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    seqs, prompt_lens = [], []
    for i in range(n):
        p, g = 6 + 5 * i, 10 + 3 * i
        seqs.append(torch.randint(3, vocab, (p + g,), generator=gen).tolist())
        prompt_lens.append(p)
    return seqs, prompt_lens


def unpadded_reference(model, seq, prompt_len, mixed):
    """One sequence alone through "kvrl_mixed" (slot i = position i), token-by-token with a
    DynamicCache: the decode path the vLLM engine is checked against."""
    model.set_attn_implementation("kvrl_mixed")
    try:
        cache, lps = DynamicCache(config=model.config), []
        for t in range(len(seq) - 1):
            logits = (
                model(
                    input_ids=torch.tensor([[seq[t]]]),
                    position_ids=torch.tensor([[t]]),
                    past_key_values=cache,
                    use_cache=True,
                    kvrl_mixed=mixed,
                )
                .logits[0, -1]
                .float()
            )
            if t + 1 >= prompt_len:
                lps.append(logits.log_softmax(-1)[seq[t + 1]].item())
        return lps
    finally:
        model.set_attn_implementation("kvrl_replay")


@torch.no_grad()
def test_score_under_mixed_gates_matches_the_unpadded_decode(engine):
    seqs, plen = sequences(engine)
    mixed = Mixed(torch.rand(4, 2, generator=torch.Generator().manual_seed(1)), sink=3, recent=7)
    scores = engine.score(seqs, plen, policy=mixed)
    for b, (s, p) in enumerate(zip(seqs, plen)):
        ref = torch.tensor(unpadded_reference(engine.model, s, p, mixed))
        torch.testing.assert_close(scores.logprobs[b, : len(ref)], ref, atol=2e-5, rtol=0)
        assert not scores.mask[b, len(ref) :].any()


@torch.no_grad()
def test_mixed_gates_at_one_and_zero_are_full_and_sink_recent(engine):
    """α = 1 is the full cache; α = 0 is the sink+recent window of head reallocation (the
    static pattern HeadAllocation deploys): one window definition for training and inference."""
    seqs, plen = sequences(engine, seed=2)
    full = engine.score(seqs, plen)
    torch.testing.assert_close(
        engine.score(seqs, plen, policy=Mixed(torch.ones(4, 2), sink=3, recent=7)).logprobs,
        full.logprobs,
        atol=1e-5,
        rtol=0,
    )
    window = HeadAllocation(gates=torch.zeros(4, 2), sparsity=1.0, layers=4, kv_heads=2, sink=3, recent=7)
    closed = engine.score(seqs, plen, policy=Mixed(torch.zeros(4, 2), sink=3, recent=7)).logprobs
    torch.testing.assert_close(closed, engine.score(seqs, plen, policy=window).logprobs, atol=1e-5, rtol=0)
    assert (closed - full.logprobs).abs().max() > 1e-2  # the window does change the scores


def test_mixed_score_refuses_a_trace(engine):
    seqs, plen = sequences(engine, n=2)
    rollouts_trace = object()
    with pytest.raises(ValueError, match="pass no trace"):
        engine.score(seqs, plen, policy=Mixed(torch.ones(4, 2)), trace=rollouts_trace)


# ---- the algorithm: gradients reach only the gates --------------------------------------------


def rlkv_config(*overrides):
    return load_config(["recipe=tiny_rlkv", *overrides])


def test_gradients_reach_only_the_gates(engine):
    cfg = rlkv_config("rlkv.l1_coef=0.1", "rlkv.tau=0.5")
    algo = RLKV(cfg)
    model = engine.model
    params = algo.setup(model, engine.tokenizer)
    assert len(params) == 1 and params[0] is algo.gates and tuple(algo.gates.shape) == (4, 2)
    assert torch.equal(algo.gates.detach(), torch.ones(4, 2))  # init 1.0
    model.requires_grad_(False)  # what the learner does: the LLM is frozen
    for p in params:
        p.requires_grad_(True)
    with torch.no_grad():
        algo.gates.copy_(torch.tensor([[1.3, 0.6], [-0.2, 0.4], [0.8, 0.1], [0.5, 0.9]]))
    out = engine.generate(
        ["3 1 4 1 5 ;", "9 2 6 ;", "5 3 5 8 9 7 ;", "2 ;"], Sampling(max_new_tokens=8, temperature=1.0, seed=3)
    )
    rewards = [1.0, 0.0, 1.0, 1.0]
    ids = [f"0/{b // 2}/{b % 2}" for b in range(4)]
    samples = rollout_samples(out, [0.7, -0.7, 0.0, 0.0], ids=ids, rewards=rewards)
    batch = collate(samples, sum(len(s.tokens) for s in samples), "cpu")
    loss, scores, metrics = algo.loss(engine, batch)
    # clamped to [0, 1] before the update, as the reference does
    assert algo.gates.min().item() == 0.0 and algo.gates.max().item() == 1.0
    loss.backward()
    assert algo.gates.grad is not None and algo.gates.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters()), "a model weight got a gradient"
    # the loss is GRPO + the penalty at r̄ = 0.75 > τ
    weight = 0.1 * math.expm1(0.75)
    assert metrics["penalty"] == pytest.approx(weight * algo.gates.detach().abs().mean().item(), rel=1e-5)
    assert loss.item() == pytest.approx(metrics["pg_loss"] + metrics["penalty"], rel=1e-5, abs=1e-7)
    # what is pushed is what the learner attends with
    state = algo.state(model)
    assert torch.equal(state["gates"], algo.gates.detach().clamp(0, 1))


def test_checkpointed_layers_recompute_the_mixed_attention(engine):
    """trainer.gradient_checkpointing=true: backward, after score() returned, recomputes each
    layer under the same mixed-gate attention; the gates' gradient equals the plain one."""
    gates = torch.tensor([[0.9, 0.6], [0.2, 0.4], [0.8, 0.1], [0.5, 0.7]])
    out = engine.generate(["3 1 4 1 5 ;", "9 2 6 ;"], Sampling(max_new_tokens=8, temperature=1.0, seed=3))
    model = engine.model
    grads = []
    for checkpointed in (False, True):
        g = gates.clone().requires_grad_(True)
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        try:
            engine.score(out, policy=Mixed(g, sink=2, recent=4)).logprobs.sum().backward()
        finally:
            model.gradient_checkpointing_disable()
            model.eval()
        grads.append(g.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_rlkv_config_errors_say_the_fix():
    with pytest.raises(ConfigError, match="workers.engine=vllm"):
        rlkv_config("workers.engine=hf")
    with pytest.raises(ConfigError, match="rl.algo=rlkv"):
        rlkv_config("rl.algo=rl_full")
    with pytest.raises(ConfigError, match="set job=rlkv"):
        rlkv_config("job=rl")
    with pytest.raises(ConfigError, match="rlkv.sparsity"):
        rlkv_config("rlkv.sparsity=1.5")
    with pytest.raises(ConfigError, match="RLKV trains without the KL term"):  # the algorithm's rule, in the gate
        rlkv_config("rl.kl_coef=0.1")


# ---- export and deployment --------------------------------------------------------------------


def test_export_roundtrip_and_ranking(tmp_path):
    gates = torch.tensor([[0.8, 0.79], [0.0, 0.3], [0.0, 0.05], [0.6, 0.0]])
    files = export_gates(gates, tmp_path, sink=4, recent=12)
    assert files["tsv"].read_text().splitlines()[0] == "0.800000\t0.790000"
    for where in (tmp_path, files["tsv"], files["safetensors"]):
        torch.testing.assert_close(load_gates(where), gates)
    from safetensors.torch import load_file

    order = load_file(str(files["safetensors"]))["ranking"].tolist()
    assert order == ranking(gates).tolist()
    assert order[:3] == [0, 1, 6]  # highest gates first; equal gates: the higher flat index first
    # sparsity s compresses exactly the last round(s·L·H) heads of the ranking
    for s in (0.25, 0.5, 0.75):
        alloc = head_allocation(
            tmp_path, s, type("C", (), {"num_hidden_layers": 4, "num_key_value_heads": 2}), sink=4, recent=12
        )
        n = int(s * 8 + 0.5)
        assert sorted(alloc.compressed_mask().flatten().nonzero().flatten().tolist()) == sorted(order[8 - n :])
    with pytest.raises(FileNotFoundError, match="an rlkv run's output_dir"):
        load_gates(tmp_path / "missing")


# ---- self-distillation sampling ---------------------------------------------------------------


def test_buckets_and_the_per_bucket_draw():
    edges = [0, 10, 20, 40]
    assert [bucket_of(n, edges) for n in (0, 9, 10, 39, 40)] == [0, 0, 1, 2, None]
    solved = [{"id": str(i), "output_len": n} for i, n in enumerate([1, 2, 3, 4, 12, 15, 25, 50])]
    kept, report = select(solved, edges, [2, 5, 1], seed=0)
    assert [r["kept"] for r in report] == [2, 2, 1] and [r["solved"] for r in report] == [4, 2, 1]
    assert [r["bucket"] for r in kept] == [0, 0, 1, 1, 2]
    assert all(edges[r["bucket"]] <= r["output_len"] < edges[r["bucket"] + 1] for r in kept)
    assert kept == select(solved, edges, [2, 5, 1], seed=0)[0]  # seeded


def test_self_distill_job_keeps_solved_tasks_that_the_rl_env_serves(tmp_path):
    """The data step on the shipped reasoner (HF engine): every kept task is one the model
    solved greedily, bucketed by its output length, and SelfDistilledEnv serves them with the
    counts task's reward."""
    from kvrl.jobs.self_distill import main

    cfg = load_config(
        [
            "recipe=tiny_self_distill",
            f"output_dir={tmp_path}",
            "workers.engine=hf",
            "self_distill.candidates=24",
            "sampling.batch_size=24",
        ]
    )
    summary = main(cfg)
    rows = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert summary["kept"] == len(rows) > 0 and summary["candidates"] == 24
    edges = cfg.self_distill.edges
    assert all(edges[r["bucket"]] <= r["output_len"] < edges[r["bucket"] + 1] for r in rows)
    assert [b["kept"] for b in summary["buckets"]] == [
        min(b["solved"], c) for b, c in zip(summary["buckets"], cfg.self_distill.counts)
    ]
    env = SelfDistilledEnv(str(tmp_path / "tasks.jsonl"), env="kvrl/counts-v0")
    first, _ = env.reset(seed=0)  # an episode's task comes from the same cursor as tasks()
    tasks = [first] + env.tasks(len(rows) - 1)
    assert sorted(t.id for t in tasks) == sorted(r["id"] for r in rows)
    t = tasks[0]
    assert env.score(t, t.meta["completion"])[0] == 1.0 and env.score(t, "no answer")[0] == 0.0


def test_self_distilled_tasks_are_read_when_drawn(tmp_path):
    """The task set is read lazily, as a data file of kvrl/math-v0 is: the data set
    holds where each row is, not the rows; its digest is the one a list of its tasks gives (a
    resume of a run that read it eagerly still matches); a malformed row names file:line."""
    rows = [
        {"id": f"t{i}", "prompt": f"{i} ; ?", "answer": str(i), "meta": {"digits": [i]}, "output_len": 3, "bucket": 0}
        for i in range(5)
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = SelfDistilledEnv(str(path), env="kvrl/counts-v0")
    eager = [Task(r["id"], r["prompt"], r["answer"], r["meta"]) for r in rows]
    assert list(env.data) == eager and env.data[3] == eager[3]
    assert env.state_dict()["data_sha256"] == TextEnv(eager).state_dict()["data_sha256"]
    path.write_text(path.read_text() + json.dumps({"id": "x", "prompt": "1 ; ?"}) + "\n")
    with pytest.raises(ValueError, match="changed while this run reads it"):  # a held list would not notice
        env.data[0]
    with pytest.raises(ValueError, match=r"tasks\.jsonl:6: no answer, meta: not a row job=self_distill writes"):
        SelfDistilledEnv(str(path), env="kvrl/counts-v0")


# ---- recipes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", CLUSTER_RECIPES)
def test_cluster_recipes_resolve_and_dry_run(recipe):
    cfg = load_config([f"recipe={recipe}"])
    assert (cfg.job, cfg.rl.algo, cfg.workers.engine) == ("rlkv", "rlkv", "vllm")
    assert (cfg.trainer.lr, cfg.rl.group_size, cfg.trainer.batch_size) == (1e-2, 4, 32 * 4)  # 32 queries x 4
    assert (cfg.rlkv.sink, cfg.rlkv.recent, cfg.rlkv.eval_sink, cfg.rlkv.eval_recent) == (128, 256, 16, 64)
    run = subprocess.run(
        [sys.executable, "-m", "kvrl.run", f"recipe={recipe}", "dry_run=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert cfg.model.path in run.stdout and "KV cache" in run.stdout


def test_paper_hyperparameters_per_model():
    table = {"rlkv_r1_llama_8b": (1e-3, 0.5), "rlkv_r1_qwen_7b": (1e-3, 0.55), "rlkv_qwen3_4b_thinking": (2.5e-3, 0.5)}
    for recipe, (beta, tau) in table.items():
        cfg = load_config([f"recipe={recipe}"])
        assert (cfg.rlkv.l1_coef, cfg.rlkv.tau) == (beta, tau), recipe
        assert cfg.sampling.max_new_tokens == 7168  # the reference's; max length 8192 with the prompt
        assert (cfg.self_distill.edges, cfg.self_distill.counts) == ([0, 2048, 4096, 6144, 8192], [600, 600, 1000, 800])


# ---- the loop: vLLM rollouts with the gates pushed after every update -------------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_tiny_rlkv_loop_pushes_gates_and_exports(tmp_path, local_ray):
    """Three steps of the tiny recipe with a large lr, so the gates move 0.2 per step: a
    worker generating with stale gates would show a logprob mismatch far above fp tolerance."""
    pytest.importorskip("vllm")
    from kvrl.jobs.rlkv import main

    cfg = rlkv_config(
        f"output_dir={tmp_path / 'run'}",
        "trainer.steps=3",
        "trainer.batch_size=16",
        "sampling.batch_size=16",
        "trainer.lr=0.2",
        "workers.timeout_s=300",
    )
    main(cfg)
    out = tmp_path / "run"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    means = [r["gate_mean"] for r in records]
    assert means[0] == 1.0 and means[2] < means[1] < means[0]  # the penalty closes the gates (r̄ ≈ 1 > τ)
    for r in records:
        assert r["mismatch_max"] < 1e-4, r  # vLLM's mixed attention = the learner's, with the pushed gates
    gates = load_gates(out)
    assert tuple(gates.shape) == (4, 2) and float(gates.min()) >= 0 and float(gates.max()) <= 1
    assert float(gates.mean()) < means[2]
    for name in ("gates.tsv", "gates.png", "reward_gates.png", "reward.png"):
        assert (out / name).stat().st_size > 0
    assert np.loadtxt(out / "gates.tsv", delimiter="\t").shape == (4, 2)


@pytest.mark.vllm
def test_eval_job_reallocates_heads_in_both_engines(tmp_path, capsys):
    """recipe=tiny_eval with exported gates: the head-reallocated row, run by the HF engine and
    by vLLM's own head reallocation, gives the same accuracy; gates that keep the tiny
    reasoner's layer-0 heads full (its fixed-offset read, see benchmarks/learning/rlkv_heads.py) beat
    the inverted ones."""
    pytest.importorskip("vllm")
    from kvrl.policies.heads import export_gates
    from kvrl.run import main

    good = torch.tensor([[0.8, 0.8], [0.0, 0.1], [0.2, 0.0], [0.1, 0.3]])
    acc = {}
    for name, gates in (("good", good), ("inverted", 1 - good)):
        export_gates(gates, tmp_path / name, sink=4, recent=12)
        for engine in ("hf", "vllm"):
            out = tmp_path / f"{name}-{engine}"
            args = [
                "recipe=tiny_eval",
                "env.num_eval_tasks=16",
                "sampling.max_new_tokens=64",
                f"output_dir={out}",
                "eval.policies=[rlkv]",
                f"eval.settings.rlkv.run={tmp_path / name}",
                "eval.settings.rlkv.sink=4",
                "eval.settings.rlkv.recent=12",
                "eval.settings.rlkv.sparsities=[0.5]",
                f"workers.engine={engine}",
            ]
            assert main(args) == 0
            rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
            assert [(r["policy"], r["point"]) for r in rows] == [("full", "-"), ("rlkv", "s=0.5")]
            acc[name, engine] = [r["accuracy"] for r in rows]
    capsys.readouterr()
    assert acc["good", "hf"] == acc["good", "vllm"] and acc["inverted", "hf"] == acc["inverted", "vllm"]
    assert acc["good", "hf"][-1] == 1.0 and acc["inverted", "hf"][-1] < 0.5
