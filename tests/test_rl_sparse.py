"""G-KV RL-Sparse and Distill (kvrl/algos/rl_sparse.py, distill.py) and their recipes.

* the learner's logprobs under the replayed G-KV trace equal the rollout's (and differ
  from the full cache's: the trace is really applied);
* the Distill loss equals T²·KL(teacher ‖ student) computed independently, is 0 when the
  student sees the full cache, and moves the student toward the teacher;
* with rl.kl_coef > 0 the KL's reference is the initial model with the full cache;
* bad settings fail with the key to fix; the cluster recipes pass the dry run;
* (slow) the RL loop with vLLM rollouts under G-KV and DeepSpeed ZeRO-2 over 2 learners:
  mismatch <= 1e-4 on every step, and the same metrics as one plain learner.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from batches import learner_batch

from kvrl.algos.distill import Distill
from kvrl.algos.rl_sparse import RLSparse
from kvrl.config import ConfigError, load_config
from kvrl.engines.base import Sampling
from kvrl.envs import make

REPO = Path(__file__).resolve().parent.parent
# a random model's sequences: 50-token prompts + 40 tokens; budget 40 evicts half of them
SMALL = ["kv.budget=40", "kv.interval=8", "sampling.temperature=1.0"]


def rollout_batch(engine, cfg, algo, n=4, seed=0):
    """n counts prompts decoded at the recipe's temperature under the algorithm's policy,
    collated as a learner gets them."""
    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=seed)
    prompts = [t.prompt for t in env.tasks(n)]
    out = engine.generate(
        prompts, Sampling(40, temperature=cfg.sampling.temperature, seed=seed), policy=algo.rollout_policy(engine.model)
    )
    return learner_batch(out, [float(b % 2) - 0.5 for b in range(n)], engine.device)


@pytest.mark.parametrize("policy", ["gkv", "rkv", "snapkv"])
def test_rl_sparse_learner_replays_the_rollout_trace(engine, policy):
    """RL-Sparse trains under any token policy of the zoo (G-KV in the paper): the rollout
    evicts with kv.policy and the learner replays its trace."""
    cfg = load_config(["recipe=tiny_gkv_sparse", *SMALL, f"kv.policy={policy}"])
    algo = RLSparse(cfg)
    assert type(algo.rollout_policy(engine.model).policy).__name__.lower() == policy
    batch = rollout_batch(engine, cfg, algo)
    assert float(batch.trace.retention().mean()) < 0.9  # the policy really evicted
    engine.model.zero_grad()
    loss, scores, metrics = algo.loss(engine, batch)
    on = batch.mask.bool()
    assert (scores.logprobs - batch.old_logprobs).abs()[on].max() <= 1e-4  # fp32, CPU
    with torch.no_grad():
        full = engine.score(batch.sequences, batch.prompt_lens, temperature=cfg.sampling.temperature)
    assert (full.logprobs - batch.old_logprobs).abs()[on].max() > 1e-3  # the full cache is another policy
    loss.backward()
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert sum(p.grad.abs().sum() for p in engine.model.parameters() if p.grad is not None) > 0
    engine.model.zero_grad()


def test_rl_sparse_rolls_out_in_gkv_ratio_mode(engine):
    cfg = load_config(["recipe=tiny_gkv_sparse", *SMALL, "kv.budget_ratio=0.75"])
    policy = RLSparse(cfg).rollout_policy(engine.model).policy
    assert (policy.budget, policy.budget_ratio, policy.budget_at(90)) == (40, 0.75, 67)


def test_rl_sparse_refuses_samples_without_a_trace(engine):
    cfg = load_config(["recipe=tiny_gkv_sparse", *SMALL])
    batch = rollout_batch(engine, cfg, RLSparse(cfg), n=2)
    batch.trace = None
    with pytest.raises(ValueError, match="without an eviction trace"):
        RLSparse(cfg).loss(engine, batch)


def test_rl_sparse_kl_reference_is_the_initial_model_with_the_full_cache(engine):
    """rl.kl_coef > 0 under RL-Sparse: the reference scores the samples with every token in view, so at the initial
    weights the KL is the compressed cache's own departure from the full one (k3, over the sampled tokens), not 0."""
    cfg = load_config(["recipe=tiny_gkv_sparse", *SMALL, "rl.kl_coef=0.1"])
    algo = RLSparse(cfg)
    algo.setup(engine.model, engine.tokenizer)
    batch = rollout_batch(engine, cfg, algo)
    with torch.no_grad():
        _, scores, metrics = algo.loss(engine, batch)
        full = engine.score(batch.sequences, batch.prompt_lens, temperature=cfg.sampling.temperature).logprobs
    on = batch.mask.bool()
    d = (full - scores.logprobs)[on]
    assert metrics["kl"] == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-4) and metrics["kl"] > 1e-4


@pytest.mark.parametrize("T, policy", [(1.0, "gkv"), (2.0, "gkv"), (1.0, "rkv"), (1.0, "snapkv")])
def test_distill_loss_is_the_soft_target_kl(engine, T, policy):
    """Under G-KV and other token policies of the zoo, whose traces Distill replays alike."""
    cfg = load_config(["recipe=tiny_gkv_distill", *SMALL, f"distill.temperature={T}", f"kv.policy={policy}"])
    algo = Distill(cfg)
    algo.setup(engine.model, engine.tokenizer)
    batch = rollout_batch(engine, cfg, algo, seed=1)
    loss, scores, metrics = algo.loss(engine, batch)
    # reference: both distributions scored at T directly (no re-tempering), torch's KL
    with torch.no_grad():
        student = engine.score(batch.sequences, batch.prompt_lens, trace=batch.trace, temperature=T, distributions=True)
        teacher = engine.score(batch.sequences, batch.prompt_lens, temperature=T, distributions=True)
    on = student.mask.bool()
    kl = F.kl_div(student.distributions[on], teacher.distributions[on], log_target=True, reduction="sum")
    assert loss.item() == pytest.approx(T**2 * kl.item() / batch.num_items, rel=1e-4)
    assert loss.item() > 1e-4 and metrics["tokens"] == int(on.sum())
    # the same sequences seen with the full cache: the student is the teacher
    batch.trace.death.fill_(batch.trace.never)
    assert algo.loss(engine, batch)[0].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("policy", ["gkv", "rkv"])
def test_distill_steps_reduce_the_kl(engine, policy):
    """A few Adam steps on one batch: the sparse student's KL to the teacher falls, under G-KV
    and under another token policy of the zoo. (On this random model and batch, SnapKV's and
    StreamingLLM's evictions leave a KL of 0.006 and 0.011 to start with, which 4 steps at this
    rate do not lower: they oscillate around it. The loss test above covers SnapKV.)"""
    cfg = load_config(["recipe=tiny_gkv_distill", *SMALL, f"kv.policy={policy}"])
    model_state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    algo = Distill(cfg)
    algo.setup(engine.model, engine.tokenizer)
    batch = rollout_batch(engine, cfg, algo, seed=2)
    opt = torch.optim.Adam(engine.model.parameters(), lr=1e-4)
    kls = []
    for _ in range(4):
        opt.zero_grad()
        loss, _, metrics = algo.loss(engine, batch)
        loss.backward()
        opt.step()
        kls.append(metrics["kl"])
    engine.model.load_state_dict(model_state)  # the module's engine is shared
    assert kls[-1] < 0.7 * kls[0], kls


@pytest.mark.parametrize(
    "recipe, arg, fix",
    [
        ("tiny_gkv_sparse", "kv.policy=full", "set kv.policy=gkv"),
        ("tiny_gkv_sparse", "kv.budget=0", "set kv.budget=64"),
        (
            "tiny_gkv_distill",
            "kv.policy=full",
            "distill trains under the eviction it is served with (G-KV's: gkv), "
            "but kv.policy='full' keeps every token; set kv.policy=gkv",
        ),
        ("tiny_gkv_distill", "rl.kl_coef=0.1", "set rl.kl_coef=0"),
    ],
)
def test_bad_settings_name_the_fix(recipe, arg, fix):
    # the algorithms' rules are the config gate's (kvrl/algos/*_config.py), stated once
    with pytest.raises(ConfigError, match=re.escape(fix)):
        load_config([f"recipe={recipe}", arg])


@pytest.mark.parametrize("recipe", ["gkv_r1_qwen_7b", "gkv_r1_llama_8b", "tiny_gkv_sparse", "tiny_gkv_distill"])
def test_recipes_pass_the_dry_run(recipe):
    run = subprocess.run(
        [sys.executable, "-m", "kvrl.run", f"recipe={recipe}", "dry_run=true"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "gkv" in run.stdout.split("KV cache")[1]  # the plan prices the G-KV cache


def run_recipe(out, *overrides) -> tuple:
    """A recipe run of kvrl's RL job into ``out`` (Ray: the ``local_ray`` fixture): (its config, its metrics rows)."""
    from kvrl.jobs.rl import main as train

    cfg = load_config([*overrides, f"output_dir={out}", "workers.timeout_s=300"])
    train(cfg)
    return cfg, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rl_sparse_loop_vllm_zero2_two_learners(tmp_path, local_ray):
    """2 steps of tiny_gkv_sparse as shipped (vLLM under G-KV, ZeRO-2 over 2 learners) and
    the same with one plain learner: the mismatch stays <= 1e-4, and the metrics agree."""
    runs = {}
    for name, extra in {"zero2": [], "ddp": ["workers.learners=1", "workers.backend=ddp"]}.items():
        overrides = ["recipe=tiny_gkv_sparse", "trainer.steps=2", "trainer.batch_size=32", "sampling.batch_size=16"]
        runs[name] = run_recipe(tmp_path / name, *overrides, *extra)[1]
    for a, b in zip(runs["zero2"], runs["ddp"]):
        # the mismatch is float32 rounding noise (~1e-5), which two reduction orders do not
        # reproduce: each run is held to its bound, not to the other's value
        assert a["mismatch_max"] <= 1e-4 and b["mismatch_max"] <= 1e-4 and a["kv_retention"] < 1.0
        for key in ("reward_mean", "loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key


@pytest.mark.parametrize("regime", ["full", "gkv", "window", "mixed"])
def test_the_stop_token_enters_the_loss_as_every_other_token(engine, regime):
    """Under every cache regime, a stopped sample's stop token is scored (its learner
    logprob equals the behaviour one and it is in the mask) and the GRPO loss weighs its
    logprob exactly as the sample's other tokens': d loss / d logprob = -A / N at every
    generated position, the stop token's included, and 0 past the sample."""
    from kvrl.algos.grpo import grpo_loss
    from kvrl.engines.hf import HFEngine
    from kvrl.policies import Full, Mixed, Static, Window

    model, tok = engine.model, engine.tokenizer
    cfg = model.config
    policy = {
        "full": lambda: Full(),
        "window": lambda: Static(Window.of(cfg, 4, 24)),
        "mixed": lambda: Mixed(torch.full((cfg.num_hidden_layers, cfg.num_key_value_heads), 0.5), 4, 24),
        "gkv": lambda: RLSparse(load_config(["recipe=tiny_gkv_sparse", *SMALL])).rollout_policy(model),
    }[regime]()
    env = make("kvrl/counts-v0")
    env.reset(seed=3)
    prompts = [t.prompt for t in env.tasks(6)]
    free = engine.generate(prompts, Sampling(max_new_tokens=40, ignore_eos=True), policy=policy)
    stop = free.tokens[0][30]  # a token this model emits late: rows that emit it stop there
    sampling = Sampling(max_new_tokens=40, temperature=1.0, seed=1)
    out = HFEngine(model, tok, stop_ids=[stop]).generate(prompts, sampling, policy=policy)
    stopped = [b for b, r in enumerate(out.finish_reasons) if r == "stop"]
    assert stopped and all(out.tokens[b][-1] == stop for b in stopped)
    batch = learner_batch(out, [(b % 3) - 1.0 for b in range(len(prompts))], "cpu")
    scores = engine.score(batch.sequences, batch.prompt_lens, policy=policy, trace=batch.trace, temperature=1.0)
    logprobs = scores.logprobs.detach().requires_grad_(True)
    loss, _ = grpo_loss(logprobs, batch.old_logprobs, batch.advantages, scores.mask, num_items=batch.num_items)
    loss.backward()
    for b in range(len(prompts)):
        n = len(out.tokens[b])
        assert scores.mask[b, :n].all() and not scores.mask[b, n:].any()
        assert (scores.logprobs[b, :n] - torch.tensor(out.logprobs[b])).abs().max() < 1e-4
        want = torch.zeros_like(logprobs[b])
        want[:n] = -batch.advantages[b] / batch.num_items  # at ratio 1, inside the clip
        assert torch.allclose(logprobs.grad[b], want, atol=1e-7), (regime, b)


def held_out_accuracy(cfg, trained) -> dict:
    """{"untrained", "trained"}: greedy accuracy under the recipe's cache on the first 64 tasks of
    benchmarks/learning/gkv_train.py's held-out stream (seed 4321; training draws from seed 0's)."""
    from kvrl.bench import draw_tasks, evaluate_under_recipe

    env, tasks = draw_tasks(cfg.env.id, 64, 4321, **cfg.env.kwargs)
    return {
        name: evaluate_under_recipe(path, cfg, env, tasks)["acc"]
        for name, path in (("untrained", "tiny"), ("trained", str(trained)))
    }


@pytest.mark.slow
def test_rl_sparse_recipe_keeps_ending_its_answers(tmp_path, local_ray):
    """The first 10 steps of tiny_gkv_sparse as shipped (vLLM rollouts under G-KV, ZeRO-2).
    With G-KV's zeroed advantage for truncated samples the model stopped ending its answers from
    step 7 (truncated 0.02 -> 0.77 -> 0.99 at step 8, every group then all-wrong and the gradient 0);
    with rl.truncated=keep no step truncates more than a quarter of its samples (measured: at most
    0.008). And the greedy accuracy under the G-KV cache on 64 held-out tasks is not below the
    untrained model's by more than 0.1, about 1.6 standard errors of a 64-task accuracy: at lr 1e-3
    RL-Sparse wrecked both of its validation runs by step 20 (0.55 -> 0.16, 0.13; docs/studies.md).
    The training batches' own accuracy is no measure of this: each step's 16 tasks are new, and
    their accuracy moves by 0.3 from one step to the next."""
    overrides = ["recipe=tiny_gkv_sparse", "trainer.steps=10", "rl.checkpoint_every=0"]
    cfg, records = run_recipe(tmp_path, *overrides)
    truncated = [r["truncated"] for r in records]
    assert max(truncated) <= 0.25, truncated
    acc = held_out_accuracy(cfg, tmp_path / "model")
    assert acc["trained"] >= acc["untrained"] - 0.1, acc


@pytest.mark.slow
def test_distill_recipe_moves_the_student_toward_the_teacher_and_keeps_its_accuracy(tmp_path, local_ray):
    """The first 10 steps of tiny_gkv_distill as shipped (vLLM rollouts under G-KV, ZeRO-2).
    Distill is for its objective: the student's KL to the full-cache teacher under the replayed
    G-KV trace falls (steps 8-10 at most 0.8x step 1's; measured 0.24 vs 0.38 at the recipe's
    3e-4, 0.14 vs 0.38 at 1e-3); no step truncates more than a quarter of its samples; and
    the greedy accuracy under the G-KV cache on 64 held-out tasks is not below the untrained
    model's by more than 0.1, about 1.6 standard errors of a 64-task accuracy (measured on 128:
    0.516 untrained, 0.633 after 10 steps at 3e-4, 0.625 at 1e-3). What looked like Distill
    decaying after step 13 was the sampled accuracy at temperature 2 of the training batches
    (0.59 -> 0.24 at 1e-3); the held-out greedy accuracy of that run rose (0.77 after 40 steps),
    so this test holds on the old recipe too: there was no loss of accuracy to catch."""
    overrides = ["recipe=tiny_gkv_distill", "trainer.steps=10", "rl.checkpoint_every=0"]
    cfg, records = run_recipe(tmp_path, *overrides)
    kl = [r["kl"] for r in records]
    assert max(r["truncated"] for r in records) <= 0.25, [r["truncated"] for r in records]
    assert sum(kl[-3:]) / 3 <= 0.8 * kl[0], kl
    acc = held_out_accuracy(cfg, tmp_path / "model")
    assert acc["trained"] >= acc["untrained"] - 0.1, acc
