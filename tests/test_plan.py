"""dry_run=true: the plan of a recipe from its model's architecture, without weights."""

import pytest

from kvrl.config import load_config
from kvrl.plan import plan
from kvrl.run import main


def test_kv_memory_of_a_known_architecture_without_weights():
    # rl.algo=rl_sparse: rl_full's rule (kv.policy=full) is the config gate's since #37
    cfg_args = ["recipe=tiny_rl_full", "rl.algo=rl_sparse", "model.path=deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
                "model.dtype=bfloat16", "kv.policy=gkv", "kv.budget=2048", "kv.interval=128",
                "sampling.max_new_tokens=8192", "sampling.batch_size=16"]
    p = plan(load_config(cfg_args))
    assert p["params"] == 8_030_261_248  # Llama-3.1-8B, counted on the meta device
    assert p["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, bf16
    assert p["kept_tokens_per_sequence"] == 2048 + 128  # the cache peaks one interval above the budget
    assert p["kv_full_bytes_per_batch"] == 16 * 8192 * p["kv_bytes_per_token"]
    assert p["cpus"] == 1.5 and p["rollout_actors"] == 2
    # G-KV's ratio mode: the budget of the whole sequence, max(2048, 0.5 x 8192 new tokens)
    ratio = plan(load_config([*cfg_args, "kv.budget_ratio=0.5"]))
    assert ratio["tokens_per_sequence"] == 8192 and ratio["kept_tokens_per_sequence"] == 4096 + 128


def test_dry_run_prints_the_plan_and_loads_nothing(capsys):
    assert main(["recipe=tiny_rl_full", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "0.8 M parameters" in out and "the Ray cluster needs 1.5 CPUs" in out


def test_unknown_model_says_what_to_pass(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here; an unknown hub id must fail cleanly
    assert main(["recipe=tiny_rl_full", "dry_run=true", f"model.path={tmp_path}/nope"]) == 2
    assert "pass a local folder with a config.json" in capsys.readouterr().err


CLUSTER = ["rlkv_r1_llama_8b", "rlkv_r1_qwen_7b", "rlkv_qwen3_4b_thinking", "gkv_r1_qwen_7b", "gkv_r1_llama_8b",
           "foresight_qwen3_4b", "foresight_qwen3_1_7b", "foresight_r1_qwen_7b"]


@pytest.mark.parametrize("recipe", CLUSTER)
def test_every_cluster_recipe_fits_80_gb_gpus(recipe, capsys):
    from kvrl.plan import dry_run

    p = dry_run(load_config([f"recipe={recipe}"]))
    out = capsys.readouterr().out
    assert "rollout peak" in out and "learner peak" in out and "WARNING" not in out, out
    for actor, parts in p["memory"].items():
        assert parts["weights"] <= sum(parts.values()) < 80 * 2 ** 30, (actor, parts)


def test_a_learner_that_would_not_fit_is_warned_with_the_fix(capsys):
    """G-KV's learner share (32 samples x ~4K tokens) in one pass keeps ~665 GB of activations."""
    from kvrl.plan import dry_run

    p = dry_run(load_config(["recipe=gkv_r1_qwen_7b", "trainer.micro_batch_tokens=0",
                             "trainer.gradient_checkpointing=false"]))
    assert p["memory"]["learner"]["activations"] > 500 * 2 ** 30
    assert "WARNING    the learner does not fit: set trainer.micro_batch_tokens" in capsys.readouterr().out


def test_the_trace_actors_are_planned_and_vllm_sizing_its_own_cache_is_warned(capsys):
    """A ForesightKV trace actor holds vLLM and the HF scorer; vLLM's own sizing fills 90 % of
    the GPU, so the recipes give it workers.kv_cache_gib."""
    from kvrl.plan import dry_run

    p = dry_run(load_config(["recipe=foresight_qwen3_4b", "workers.kv_cache_gib=0"]))
    parts = p["memory"]["trace actor"]
    assert parts["scoring weights"] == parts["weights"] == p["weights_bytes"] and parts["scoring forward"] > 0
    assert "WARNING    the trace actor does not fit: set workers.kv_cache_gib" in capsys.readouterr().out
    assert main(["recipe=tiny_foresight", "job=foresight_traces", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "traces     2 rollout actors (vllm + hf scoring" in out and "trace actor peak" in out
    assert "learner" not in out  # the data step alone starts no learner


@pytest.mark.parametrize("recipe", ["eval_math_qwen3_4b", "eval_math_r1_qwen_7b", "eval_math_r1_llama_8b"])
def test_eval_math_recipes_plan_the_papers_budgets(recipe, capsys):
    assert main([f"recipe={recipe}", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "x budgets 128, 256, 512, 1024, 2048, 4096" in out and "KV per sequence at 4096 tokens" in out
