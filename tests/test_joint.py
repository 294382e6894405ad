"""RL-Sparse and Distill under a trained ForesightKV scorer, frozen (``kv.policy=learned``, ``kv.kwargs.run``).

* the rollout policy is the run's trained scorer (not a fresh initialisation), and only the model's
  weights are pushed to the rollout workers: the scorer stays as trained;
* shrunk, each runs 2 steps through the RL loop (inline, HF engine; the vLLM engine where installed):
  the scorer really evicts (``kv_retention`` < 1) and the learner replays the rollouts' traces
  (``mismatch_max`` <= 1e-3, as the other replay tests);
* a missing ``kv.kwargs.run`` is refused by the config, and a folder holding no trained scorer by the
  gate before the run starts (status 2), each naming the fix.

The scorer is the shipped one job=foresight trained on the tiny reasoner (``tiny_foresight``'s stage 2,
``kvrl/models/weights/tiny_artefacts``), laid out as a run's output_dir: training one here would cost
minutes for nothing these tests read.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrl.algos.distill import Distill
from kvrl.algos.rl_sparse import RLSparse
from kvrl.config import ConfigError, load_config
from kvrl.models import WEIGHTS
from kvrl.models.tiny import load_model

SCORER = WEIGHTS / "tiny_artefacts" / "foresight_scorer.safetensors"
RECIPES = {"rl_sparse": "tiny_gkv_sparse", "distill": "tiny_gkv_distill"}
# tiny_gkv_*'s budget 76 of the ~100-token sequences; changing kv.policy drops the recipe's G-KV kv.kwargs
LEARNED = ["kv.policy=learned"]


@pytest.fixture(scope="module")
def scorer_run(tmp_path_factory):
    """A job=foresight output_dir holding its stage-2 scorer, rl/scorer.safetensors."""
    run = tmp_path_factory.mktemp("foresight")
    (run / "rl").mkdir()
    shutil.copy(SCORER, run / "rl" / "scorer.safetensors")
    return run


@pytest.mark.parametrize("algo, cls", [("rl_sparse", RLSparse), ("distill", Distill)])
def test_the_rollout_policy_is_the_trained_scorer_and_stays_frozen(scorer_run, algo, cls):
    cfg = load_config([f"recipe={RECIPES[algo]}", *LEARNED, f"kv.kwargs.run={scorer_run}"])
    model, _ = load_model("tiny")
    algorithm = cls(cfg)
    policy = algorithm.rollout_policy(model).policy
    trained = load_file(str(SCORER))
    assert trained.keys() == policy.scorer.state_dict().keys()
    assert all(torch.equal(policy.scorer.state_dict()[k], v) for k, v in trained.items())
    assert (policy.budget, policy.interval, policy.window, policy.sink) == (76, 16, 8, 4)
    push = algorithm.state(model)
    assert push.weights is not None and push.cache is None  # the rollout workers' scorer is never replaced


ENGINES = [
    pytest.param("hf", id="hf"),
    pytest.param("vllm", id="vllm", marks=[pytest.mark.vllm, pytest.mark.slow]),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("algo", ["rl_sparse", "distill"])
def test_joint_recipe_replays_the_scorers_eviction_through_the_loop(tmp_path, scorer_run, algo, engine):
    """2 steps of 16 samples, one rollout worker and one learner in this process."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    from kvrl.jobs.rl import main as train

    out = tmp_path / "run"
    train(
        load_config(
            [
                f"recipe={RECIPES[algo]}",
                *LEARNED,
                f"kv.kwargs.run={scorer_run}",
                f"workers.engine={engine}",
                "workers.address=inline",
                "workers.rollout=1",
                "workers.learners=1",
                "workers.backend=ddp",
                "trainer.steps=2",
                "trainer.batch_size=16",
                "sampling.batch_size=16",
                "rl.checkpoint_every=0",
                f"output_dir={out}",
            ]
        )
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["kv_retention"] < 1.0  # the scorer evicted
        assert r["mismatch_max"] <= 1e-3  # the learner replayed the rollout's trace
    assert (out / "model").is_dir()


@pytest.mark.parametrize("algo", ["rl_sparse", "distill"])
def test_learned_without_a_run_is_refused_by_the_config(algo):
    with pytest.raises(ConfigError) as info:
        load_config([f"recipe={RECIPES[algo]}", *LEARNED])
    message = str(info.value)
    assert f"{algo} with kv.policy=learned" in message and "kv.kwargs.run does not name one" in message
    assert "train one with job=foresight" in message and "set kv.kwargs.run=DIR" in message


@pytest.mark.parametrize("where, found", [("missing", "no such file or folder"), ("untrained", "no trained scorer")])
def test_a_run_without_a_trained_scorer_is_refused_before_it_starts(tmp_path, capsys, where, found):
    from kvrl.run import main

    run = tmp_path / where
    if where == "untrained":  # a job=foresight run stopped before its first stage wrote a scorer
        (run / "traces").mkdir(parents=True)
    args = ["recipe=tiny_gkv_sparse", *LEARNED, f"kv.kwargs.run={run}", f"output_dir={tmp_path / 'out'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"kv.kwargs.run={str(run)!r}: {found}" in err and "train one with job=foresight" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("recipe", ["tiny_multihop_joint_sparse", "tiny_multihop_joint_distill"])
def test_the_multihop_joint_recipes_run_through_their_loop(tmp_path, recipe):
    """The shipped multihop recipes, shrunk to one step of 8 short samples, under a scorer of the multihop
    reasoner's geometry (untrained: the loop does not care what it learned) at their budget 117."""
    from kvrl.algos.foresight import scorer_state
    from kvrl.jobs.rl import main as train
    from kvrl.policies import make_policy

    model, _ = load_model("tiny-multihop")
    run = tmp_path / "foresight"
    (run / "rl").mkdir(parents=True)
    scorer = make_policy("learned", model.config, budget=117, interval=16, window=8, sink=4)
    save_file(scorer_state(scorer), run / "rl" / "scorer.safetensors")
    out = tmp_path / "run"
    overrides = ["workers.address=inline", "workers.rollout=1", "workers.learners=1", "workers.backend=ddp"]
    overrides += ["workers.engine=hf", "trainer.steps=1", "trainer.batch_size=8", "sampling.batch_size=8"]
    overrides += ["sampling.max_new_tokens=48", "rl.checkpoint_every=0", f"kv.kwargs.run={run}", f"output_dir={out}"]
    train(load_config([f"recipe={recipe}", *overrides]))
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["kv_retention"] < 1.0 and record["mismatch_max"] <= 1e-3
