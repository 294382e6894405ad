"""The formulations on the multihop reasoner (``recipes/tiny_multihop_*.yaml``): G-KV's RL-Sparse,
Distill and RL-Full, RLKV and ForesightKV.

* partial credit (``MultiHopEnv(partial_credit=w)``) adds w x the share of queries right to the
  exact answer, and gives groups of samples under G-KV a spread where the exact answer gives
  none (the learning signal GRPO needs);
* RL-Full's recipe is RL-Sparse's but for the cache, so that their comparison is the cache's;
* each G-KV recipe, shrunk, moves its loss on a batch rolled out by the shipped multihop reasoner
  under its G-KV cache, and runs through the RL loop with a signal in its groups and the
  learner replaying the rollout's traces;
* RLKV's recipe, shrunk, closes its gates in its loop; ForesightKV's, shrunk, lowers its ranking loss
  through the whole pipeline.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from batches import learner_batch

from kvrl.algos.distill import Distill
from kvrl.algos.grpo import group_advantages
from kvrl.algos.rl_sparse import RLSparse
from kvrl.config import load_config
from kvrl.engines.base import Sampling
from kvrl.engines.hf import HFEngine
from kvrl.envs import make
from kvrl.models.tiny import load_model
from kvrl.section import ConfigError

# tasks of the pretraining curriculum's middle sizes (~130-token sequences), under a budget that evicts
SMALL_TASKS = [
    "env.kwargs.min_statements=12",
    "env.kwargs.max_statements=16",
    "env.kwargs.min_queries=2",
    "env.kwargs.max_queries=3",
    "env.kwargs.min_depth=2",
    "env.kwargs.max_depth=4",
]
SHRUNK = [*SMALL_TASKS, "kv.budget=48", "sampling.max_new_tokens=200"]


@pytest.fixture(scope="module")
def engine():
    return HFEngine(*load_model("tiny-multihop"))


def test_partial_credit_adds_the_share_of_queries_right():
    env = make("kvrl/multihop-v0", partial_credit=0.5)
    env.reset(seed=0)
    task = env.tasks(1)[0]
    ref = task.meta["completion"]
    n = len(task.answer.split())
    wrong = ref.rsplit("\\boxed{", 1)[0] + "\\boxed{ " + " ".join(["x"] + task.answer.split()[1:]) + " }"
    assert env.score(task, ref)[0] == pytest.approx(1.5)
    reward, info = env.score(task, wrong)
    assert reward == pytest.approx(0.5 * (1 - 1 / n)) and info["correct"] == 0.0
    assert make("kvrl/multihop-v0").score(task, wrong)[0] == 0.0  # the default is the exact answer
    with pytest.raises(ValueError, match="partial_credit"):
        make("kvrl/multihop-v0", partial_credit=-1.0)


def test_segments_credit_each_query_with_its_own_answer():
    env = make("kvrl/multihop-v0")
    env.reset(seed=0)
    task = env.tasks(1)[0]
    ref = task.meta["completion"]
    words, queries = ref.split() + ["</s>"], task.meta["queries"]
    seg, credit = env.segments(task, ref, words)
    assert credit == [1.0] * len(queries) and len(seg) == len(words)
    box = words.index("\\boxed{")
    for i, (q, chain) in enumerate(zip(queries, task.meta["chains"])):
        span = [k for k in range(box) if seg[k] == i]
        assert span == list(range(span[0], span[0] + 7 * len(chain)))  # its whole segment, contiguous
        assert words[span[0]] == q and words[span[-4] : span[-1] + 1][:2] == [q, "="]  # its walk, to its conclusion
        assert seg[box + 1 + i] == i  # and its digit in the box
    assert seg[box] == seg[-2] == seg[-1] == -1  # the brackets and the stop token: no query's
    # a wrong digit takes that query's credit only; a chain of thought cut short leaves its query the rest
    wrong = ref.replace("\\boxed{ " + task.answer, "\\boxed{ " + " ".join(["x"] + task.answer.split()[1:]))
    assert env.segments(task, wrong, wrong.split())[1] == [0.0] + [1.0] * (len(queries) - 1)
    cut = words[: 3 * 7 + 2]  # stops inside the first query's walk (chains are >= 6 statements long)
    seg, credit = env.segments(task, " ".join(cut), cut)
    assert seg == [0] * len(cut) and credit == [0.0] * len(queries)


def test_segment_credit_is_refused_where_the_loss_ignores_token_advantages():
    with pytest.raises(ConfigError, match="rl.credit=sequence"):
        load_config(["recipe=tiny_multihop_distill", "rl.credit=segment"])
    assert load_config(["recipe=tiny_multihop_sparse", "rl.credit=segment"]).rl.credit == "segment"


def test_rl_full_differs_from_rl_sparse_only_in_the_cache():
    """benchmarks/learning/multihop_gkv.py compares the two as "trained with the full cache" against
    "trained under G-KV": any other difference (a learning rate, the reward) would be part of that."""
    full = load_config(["recipe=tiny_multihop_full"])
    sparse = load_config(["recipe=tiny_multihop_sparse"])
    assert (full.kv.policy, full.rl.algo, sparse.rl.algo) == ("full", "rl_full", "rl_sparse")
    for section in ("model", "env", "sampling", "trainer", "workers"):
        assert getattr(full, section) == getattr(sparse, section), section
    a, b = vars(full.rl).copy(), vars(sparse.rl).copy()
    assert {k: v for k, v in a.items() if k != "algo"} == {k: v for k, v in b.items() if k != "algo"}


@pytest.mark.slow
def test_partial_credit_gives_groups_under_gkv_a_signal(engine):
    """The recipe's setting (G-KV at budget 235, temperature 1), 8 tasks x 4 samples of the
    validation stream: the exact answer is rarely earned, and partial credit differs within
    most groups (0.75 of 16 groups of 8 in multihop_signal.py). On smaller tasks with a
    proportionally smaller budget (64 of ~130 tokens) most samples get no query right at all,
    so this runs at full size: ~1 CPU-minute."""
    cfg = load_config(["recipe=tiny_multihop_sparse"])
    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=7001)  # the validation stream
    tasks = env.tasks(8)
    algo = RLSparse(cfg)
    out = engine.generate(
        [t.prompt for t in tasks for _ in range(4)],
        Sampling(cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature, seed=1),
        policy=algo.rollout_policy(engine.model),
    )
    scored = [env.score(tasks[i // 4], text) for i, text in enumerate(out.texts)]
    partial = np.array([r for r, _ in scored]).reshape(8, 4)
    exact = np.array([info["correct"] for _, info in scored]).reshape(8, 4)
    assert exact.mean() < 0.25, exact  # the regime where the exact answer alone leaves GRPO nothing
    assert (partial.std(1) > 0).mean() >= 0.5, partial


def multihop_batch(engine, cfg, algo, n_tasks=4, group=4, seed=0):
    """A group of samples per task, decoded under the algorithm's rollout policy, with GRPO
    advantages of the environment's reward, collated as a learner gets them."""
    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=seed)
    tasks = env.tasks(n_tasks)
    out = engine.generate(
        [t.prompt for t in tasks for _ in range(group)],
        Sampling(cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature, seed=seed),
        policy=algo.rollout_policy(engine.model),
    )
    rewards = torch.tensor([env.score(tasks[b // group], out.texts[b])[0] for b in range(len(out.texts))])
    adv = group_advantages(rewards, group)
    return learner_batch(out, [float(a) for a in adv], engine.device)


@pytest.mark.parametrize(
    "recipe, algo_cls, key", [("tiny_multihop_sparse", RLSparse, "loss"), ("tiny_multihop_distill", Distill, "kl")]
)
def test_multihop_recipes_move_their_loss(engine, recipe, algo_cls, key):
    """A few Adam steps at the recipe's learning rate on one batch the shipped reasoner rolled
    out under the recipe's G-KV cache (shrunk): RL-Sparse's clipped surrogate loss falls,
    Distill's KL to the full-cache teacher falls. (At 1e-3 the surrogate rises after the first
    step on such a batch, which is why the recipes train at a lower rate.)"""
    cfg = load_config([f"recipe={recipe}", *SHRUNK])
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    algo = algo_cls(cfg)
    algo.setup(engine.model, engine.tokenizer)
    batch = multihop_batch(engine, cfg, algo)
    assert float(batch.trace.retention().mean()) < 0.9  # the shrunk budget really evicts
    opt = torch.optim.Adam(engine.model.parameters(), lr=cfg.trainer.lr)
    values = []
    try:
        for _ in range(4):
            opt.zero_grad()
            loss, _, metrics = algo.loss(engine, batch)
            loss.backward()
            opt.step()
            values.append(loss.item() if key == "loss" else metrics[key])
    finally:
        engine.model.load_state_dict(state)  # the module's engine is shared
    if key == "loss":
        assert values[-1] < values[0] - 0.003 and values[-1] == min(values), values
    else:
        assert values[-1] < 0.8 * values[0], values


@pytest.mark.slow
@pytest.mark.parametrize("credit", ["sequence", "segment"])
def test_multihop_sparse_recipe_runs_with_a_signal(tmp_path, credit):
    """tiny_multihop_sparse, shrunk, through the RL loop (one vLLM rollout worker, one learner,
    in this process): every step has groups with a spread, and the learner replays the traces;
    under rl.credit=segment too (the advantages per token, from the queries' own answers)."""
    from kvrl.jobs.rl import main as train

    out = tmp_path / "run"
    train(
        load_config(
            [
                "recipe=tiny_multihop_sparse",
                *SHRUNK,
                "trainer.steps=2",
                "trainer.batch_size=32",
                "sampling.batch_size=32",
                f"output_dir={out}",
                "workers.address=inline",
                "workers.rollout=1",
                "workers.learners=1",
                "workers.backend=ddp",
                f"rl.credit={credit}",
            ]
        )
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["no_signal"] == 0 and r["adv_abs_mean"] > 0 for r in records)
    for r in records:
        assert r["zero_std_groups"] < 1.0 and r["kv_retention"] < 1.0
        assert r["mismatch_max"] <= 1e-3  # float32 replay of the vLLM rollout
    assert Path(out / "model").is_dir()


@pytest.mark.slow
@pytest.mark.vllm
def test_multihop_rlkv_recipe_closes_gates_in_its_loop(tmp_path):
    """tiny_multihop_rlkv, shrunk to 2 tasks x 4 samples a step, through the RL loop (one vLLM rollout
    worker, one learner, in this process) at a large lr: the full cache solves the tasks (r̄ > τ), so
    the penalty closes the gates step by step, and vLLM's mixed attention under the pushed gates
    equals the learner's. (The curriculum's small tasks would not do: the shipped reasoner, trained
    to the full size, gets none of them right.)"""
    pytest.importorskip("vllm")
    from kvrl.jobs.rlkv import main as train
    from kvrl.policies.heads import load_gates

    out = tmp_path / "run"
    train(
        load_config(
            [
                "recipe=tiny_multihop_rlkv",
                "trainer.steps=3",
                "trainer.batch_size=8",
                "sampling.batch_size=8",
                "trainer.lr=0.2",
                "rl.checkpoint_every=0",
                f"output_dir={out}",
                "workers.address=inline",
            ]
        )
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    means = [r["gate_mean"] for r in records]
    assert records[0]["reward_mean"] > 0.7 and means[0] == 1.0 and means[2] < means[1] < means[0], records
    assert all(r["mismatch_max"] < 1e-4 for r in records), [r["mismatch_max"] for r in records]
    assert tuple(load_gates(out).shape) == (4, 2)


@pytest.mark.slow
def test_multihop_foresight_recipe_learns_its_ranking(tmp_path):
    """tiny_multihop_foresight, shrunk to 8 traces, through the whole pipeline: the stage-1 ranking loss
    falls, stage 2 runs on the controller, and every policy is judged."""
    from kvrl.algos.foresight import RULE_BASED
    from kvrl.run import main

    args = [
        "recipe=tiny_multihop_foresight",
        f"output_dir={tmp_path}",
        "foresight.traces=8",
        "foresight.heldout=4",
        "foresight.shard_size=4",
        "foresight.sft_steps=30",
        "foresight.sft_batch_size=4",
        "trainer.log_every=10",
        "trainer.steps=2",
        "trainer.batch_size=8",
        "rl.group_size=4",
        "sampling.batch_size=8",
    ]
    assert main(args) == 0
    sft = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in sft if r["stage"] == "sft"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["accuracy"]) == {"full", "foresight_sft", "foresight_rl", *RULE_BASED}
    assert result["accuracy"]["full"]["accuracy"] >= 0.75  # the shipped reasoner, greedy (~0.99 on 256 tasks)


FORMULATIONS = {
    "rl_sparse",
    "rl_full",
    "distill",
    "foresight",
    "foresight_general",
    "rlkv",
    "joint_rl_sparse",
    "joint_distill",
}


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("multihop_*.json")), ids=str
)
def test_multihop_results_files_say_what_they_measured(path):
    """Each formulation's recorded line names what a reader needs to trust it without rerunning hours:
    the baseline, both accuracies inside their 95 % intervals, the held-out test stream (>= 256 tasks,
    another seed than training's), and the commit it ran at, with no uncommitted code."""
    line = json.loads(path.read_text())
    if line["benchmark"] == "multihop_signal":  # where the samples go wrong, on the validation stream: no test accuracy
        assert line["validation_seed"] != 9001 and line["tasks"] >= 32 and line["lines"], line
        assert all(0 <= r["errors"]["walk"] + r["errors"]["copy"] <= 1 for r in line["lines"]), line
        assert len(line["commit"]) == 40, line  # recorded from a clean tree
        return
    if "formulation" not in line:  # the zoo's line, which the formulations' pictures draw
        assert line["benchmark"] == "multihop_zoo" and line["tasks"] >= 256
        return
    if line["benchmark"] in ("multihop_golden_gap", "multihop_scorer_fit"):  # why a scorer falls short: no accuracy
        assert line["budget"] and Path(line["run"]).name and line["train_commits"] and len(line["commit"]) == 40
        assert line["heldout_traces"] >= 16, line
        return
    assert line["formulation"] in FORMULATIONS and line["task"] == "multihop", line
    if line["benchmark"] == "multihop_foresight_general_choice":  # a choice: its test lines are files of their own
        assert line["validation_seed"] not in (None, line.get("test_seed")) and line["validation_tasks"] > 0, line
        assert line["chosen"]["mean_acc"] == max(row["mean_acc"] for row in line["validation"].values()), line
        root = Path(__file__).resolve().parents[1]
        assert line["test_results"] and all((root / f).exists() for f in line["test_results"]), line
        assert len(line["commit"].removesuffix("-dirty")) == 40
        return
    if line["benchmark"] == "multihop_gkv_choice":  # a choice whose test line is this one: the max on validation
        # the chosen (rate, length[, temperature]); lines recorded before temperature was a candidate lack it
        c = line["chosen"]
        (chosen,) = [
            row
            for row in line["validation"].values()
            if (row["lr"], row["steps"], row.get("temperature")) == (c["lr"], c["steps"], c.get("temperature"))
        ]
        assert chosen["acc"] == max(row["acc"] for row in line["validation"].values()), line
        assert line["validation_seed"] not in (None, line["test_seed"]) and line["validation_tasks"] > 0, line
    gkv_runs = [line, *line.get("per_seed", [])] if line["benchmark"] == "multihop_gkv" else []
    for run in gkv_runs:  # early stopping: the length judged is the validation's best
        if stopped := run.get("stopped_on_validation"):
            best = max(stopped["acc"].items(), key=lambda kv: (kv[1], -int(kv[0])))
            assert int(best[0]) == stopped["steps"] == run["training"]["steps"], run
            assert stopped["validation_seed"] != run["test_seed"] and stopped["validation_tasks"] > 0, run
    for key in ("budget", "baseline", "validation_seed", "test_seed", "train_seed"):
        assert key in line, f"{path.name} has no {key!r}"
    for side in ("trained", "baseline"):
        lo, hi = line[f"{side}_ci95"]
        assert lo <= line[f"{side}_acc"] <= hi, (side, line)
    tasks = line.get("n", line.get("tasks"))  # lines recorded before "n" held their count as "tasks" only
    assert tasks >= 256 and line["test_seed"] != line["train_seed"], line
    commit, dirty = line["commit"].removesuffix("-dirty"), line.get("dirty_files", [])
    assert len(commit) == 40 and int(commit, 16) >= 0 and (line["commit"].endswith("-dirty") == bool(dirty))
    code = [f for f in dirty if f.endswith((".py", ".yaml", ".cpp", ".toml", ".cfg"))]
    assert not code, f"{path.name} was recorded with uncommitted code: {code}; rerun it from a clean tree"


def test_multihop_gkv_over_seeds_averages_each_seeds_own_baseline():
    """``multihop_gkv.py --seeds``: under a joint formulation each seed trains under its own scorer, so the
    scorer path must name the seed, and the line's baseline is the mean of each seed's own untrained model."""
    spec = importlib.util.spec_from_file_location(
        "multihop_gkv", Path(__file__).resolve().parents[1] / "benchmarks/learning/multihop_gkv.py"
    )
    gkv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gkv)
    with pytest.raises(SystemExit, match=r"\{seed\}"):
        gkv.main(["--formulation", "joint_distill", "--seeds", "0,1", "--scorer", "runs/b117-s0"])

    lines = [
        {
            "kv": {"policy": "learned", "budget": 117, "run": f"runs/b117-s{seed}"},
            "tasks": 256,
            "train_seed": seed,
            "train_commits": ["c"],
            "training": {},
            "cpu_split": {},
            "trained_acc": trained,
            "baseline_acc": untrained,
            "trained_query_acc": 0.7,
            "baseline_query_acc": 0.5,
            "gain_points": round(100 * (trained - untrained), 2),
        }
        for seed, trained, untrained in [(0, 0.305, 0.133), (1, 0.25, 0.10), (2, 0.20, 0.15)]
    ]
    over = gkv.over_seeds(lines)
    assert over["trained_acc"] == pytest.approx(0.2517, abs=1e-4) and over["baseline_acc"] == pytest.approx(
        0.1277, abs=1e-4
    )
    assert over["gain_points_per_seed"] == [17.2, 15.0, 5.0] and over["gain_points"] == pytest.approx(12.4, abs=0.01)
    assert over["kv"]["run"] == ["runs/b117-s0", "runs/b117-s1", "runs/b117-s2"] and over["train_seed"] == [0, 1, 2]
    lo, hi = over["trained_ci95"]
    assert lo < 0.20 and hi > 0.305, "the interval is over seeds: wider than the spread of the three"


def test_multihop_gkv_early_stopping_judges_a_kept_model_or_says_which(tmp_path):
    """``--stop-on-validation`` judges the model a run held at each length: the one kept at a run's end, else the
    checkpoint's; a length with neither is refused naming what can be judged, and so are --steps and --stream
    beside it (the length is chosen, on the validation stream)."""
    spec = importlib.util.spec_from_file_location(
        "multihop_gkv", Path(__file__).resolve().parents[1] / "benchmarks/learning/multihop_gkv.py"
    )
    gkv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gkv)
    for folder in ("model-step40", "checkpoints/step_000040/model", "checkpoints/step_000010/model"):
        (tmp_path / folder).mkdir(parents=True)
    assert gkv.kept_model(tmp_path, 40) == tmp_path / "model-step40"
    assert gkv.kept_model(tmp_path, 10) == tmp_path / "checkpoints/step_000010/model"
    with pytest.raises(SystemExit, match="checkpoint_every"):
        gkv.kept_model(tmp_path, 15)
    for extra in (["--steps", "40"], ["--stream", "validation"]):
        with pytest.raises(SystemExit, match="drop --steps and --stream"):
            gkv.main(["--formulation", "rl_sparse", "--stop-on-validation", "10,40", *extra])


def test_multihop_foresight_pictures_redraw_from_the_recorded_files(tmp_path):
    """``multihop_foresight.py --redraw`` draws both pictures from benchmarks/results alone: the recorded lines hold
    every point the pictures draw (a line that lost a policy's accuracy or added loss fails here, not in a user's
    redraw after hours of judging)."""
    spec = importlib.util.spec_from_file_location(
        "multihop_foresight", Path(__file__).resolve().parents[1] / "benchmarks/learning/multihop_foresight.py"
    )
    foresight = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(foresight)
    foresight.redraw(tmp_path / "multihop_foresight.png")
    for name in ("multihop_foresight.png", "multihop_foresight_general.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name
