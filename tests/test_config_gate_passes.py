"""What the config gate lets through, without Ray: every shipped recipe, model paths and run
directories that can work, a resume that changes only what ``config.resumable`` names, an output
dir of a kvrl run, the README's example, and the command line's own env kwargs; an unreachable
hub and ``sampling.top_p`` outside eval are refused.
"""

import json
import os
import subprocess
import sys

import pytest
from gate_cases import REPO, earlier_run

from kvrl.config import ConfigError, load_config
from kvrl.preflight.machine import hub_problems, run_problems
from kvrl.preflight.names import env_problems, model_problems
from kvrl.run import main


def test_every_recipe_passes_the_gate_without_ray():
    script = (
        "import sys; from kvrl.config import available_recipes, load_config\n"
        "for name in available_recipes(): load_config([f'recipe={name}'])\n"
        "assert 'ray' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVRL_RECIPES_DIR"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "path", ["tiny", "Qwen/Qwen3-4B", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "my-org/my.model_2"]
)
def test_model_paths_that_can_work(path):
    assert model_problems(path) == []


def test_a_saved_model_folder_passes(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert model_problems(str(tmp_path)) == []
    assert model_problems(str(tmp_path / "config.json"))  # a file is not a model folder


def test_a_resume_may_change_what_config_resumable_names(tmp_path, monkeypatch):
    """The gate compares a checkpoint's settings as the job does: trainer.steps (Config.RESUMABLE) may change,
    resume=never starts afresh, a run over a data set derives model.max_model_len when it is 0; trainer.lr may not."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    earlier_run(tmp_path, "model.max_model_len=300")
    assert run_problems(load_config(["recipe=tiny_rl_full", f"output_dir={tmp_path}", "trainer.steps=80"])) == []
    assert run_problems(load_config(["recipe=tiny_rl_full", f"output_dir={tmp_path}", "model.max_model_len=300"])) == []
    changed = ["recipe=tiny_rl_full", f"output_dir={tmp_path}", "model.max_model_len=256"]
    [err] = run_problems(load_config(changed))
    assert "model.max_model_len: 300 -> 256" in err
    assert run_problems(load_config([*changed, "resume=never"])) == []
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    [err] = run_problems(load_config([*changed, "resume=never", f"resume={checkpoint}"]))
    assert f"(checkpoint {checkpoint})" in err


def test_an_output_dir_of_a_kvrl_run_or_empty_passes(tmp_path, monkeypatch):
    """What output_dir refuses (a folder of other files) leaves a rerun its own folder: an interrupted job=eval
    run's (its lock and settings), and an empty folder."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    run, empty = tmp_path / "eval", tmp_path / "empty"
    run.mkdir(), empty.mkdir()
    (run / ".lock").write_text("")
    (run / "settings.json").write_text('{"settings": {}, "files": {}}')
    for folder in (run, empty):
        assert run_problems(load_config(["recipe=tiny_eval", f"output_dir={folder}"])) == []


def test_inputs_are_checked_for_a_run_here_only(tmp_path, monkeypatch):
    """dry_run plans for another machine, where the data is: a missing data file is no error there."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    args = [
        "recipe=tiny_rl_full",
        "env.id=kvrl/math-v0",
        "env.kwargs.path=/no/such/aime.jsonl",
        f"output_dir={tmp_path}",
    ]
    assert main([*args, "dry_run=true"]) == 0
    assert main([*args, "print_config=true"]) == 0


def test_an_unreachable_hub_is_refused(monkeypatch):
    """A hub id that is not cached, with the network allowed but no answer: refused with the fix, not left to
    the download's retries. (An endpoint that refuses connections: no network is needed.)"""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    [err] = hub_problems("kvrl-test/no-such-model")
    assert "model.path=kvrl-test/no-such-model is not in the local Hugging Face cache" in err
    assert "the hub (http://127.0.0.1:9) cannot be reached (" in err and "set model.path=DIR" in err
    assert hub_problems("tiny") == hub_problems("/no/such/folder/") == []  # not hub ids


def test_top_p_is_for_eval():
    assert load_config(["recipe=tiny_eval", "sampling.temperature=0.6", "sampling.top_p=0.9"]).sampling.top_p == 0.9
    assert load_config(["recipe=eval_math_qwen3_4b"]).sampling.top_p == 0.95  # the papers' sampling


def test_run_directories_as_model_path(tmp_path):
    """The output_dir of a run that saved model weights passes; an RLKV or ForesightKV run is
    refused with the eval policy to use instead and its base model; a run without a sealed
    model yet says so. Nothing is read but names (kvrl.runlog.trained_model, verify=False)."""

    def checkpoint(run, step, config, model=False):
        folder = run / "checkpoints" / f"step_{step:06d}"
        (folder / "model").mkdir(parents=True) if model else folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))
        if model:
            (folder / "model" / "SHA256SUMS").write_text("")
        (folder / "SHA256SUMS").write_text("")

    sparse = tmp_path / "sparse"
    checkpoint(sparse, 10, {"job": "rl", "rl.algo": "rl_sparse", "model.path": "tiny"}, model=True)
    assert model_problems(str(sparse)) == []
    rlkv = tmp_path / "rlkv"
    checkpoint(rlkv, 5, {"job": "rlkv", "rl.algo": "rlkv", "model.path": "Qwen/Qwen3-4B"})
    (rlkv / "gates.safetensors").write_bytes(b"")
    [err] = model_problems(str(rlkv))
    assert "is an RLKV run: it trained per-head gates, not model weights" in err
    assert f"set model.path=Qwen/Qwen3-4B and eval.settings.NAME='{{policy: heads, run: {rlkv}}}'" in err
    foresight = tmp_path / "foresight"
    (foresight / "sft").mkdir(parents=True)
    (foresight / "sft" / "scorer.safetensors").write_bytes(b"")
    checkpoint(foresight / "rl", 20, {"job": "foresight", "rl.algo": "foresight", "model.path": "tiny"})
    for run in (foresight, foresight / "rl"):
        [err] = model_problems(str(run))
        assert f"set model.path=tiny and eval.settings.NAME='{{policy: learned, run: {run}}}'" in err, err
    early = tmp_path / "early"
    early.mkdir()
    (early / "metrics.jsonl").write_text("")
    [err] = model_problems(str(early))
    assert "holds no trained model yet" in err and f"rerun it with output_dir={early}" in err


def test_readme_example_math_env_on_an_rl_recipe(tmp_path, monkeypatch):
    """`env.id=kvrl/math-v0 env.kwargs.path=FILE` on a recipe over counts: the recipe's n_digits is dropped."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n" for i in range(3)))
    cfg = load_config(["recipe=tiny_rl_full", "env.id=kvrl/math-v0", f"env.kwargs.path={data}"])
    assert (cfg.env.id, cfg.env.kwargs) == ("kvrl/math-v0", {"path": str(data)})
    from kvrl.envs import make

    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=0)
    assert len(env.tasks(3)) == 3


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ([], {"n_digits": 24}),  # the recipe's
        (["env.kwargs.n_digits=8"], {"n_digits": 8}),  # one key merges
        (["env.kwargs={}"], {}),  # a mapping given whole replaces the recipe's: {} clears it
        (["env.kwargs={n_digits: 8}"], {"n_digits": 8}),
        (["env.id=kvrl/counts-v0"], {"n_digits": 24}),  # the same environment keeps its arguments
        (["env.id=kvrl/chains-v0"], {}),  # another environment drops them
        (["env.id=kvrl/chains-v0", "env.kwargs.min_depth=2"], {"min_depth": 2}),
    ],
)
def test_the_command_line_owns_the_kwargs_of_what_it_changes(monkeypatch, args, kwargs):
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    assert load_config(["recipe=tiny_rl_full", *args]).env.kwargs == kwargs


def test_env_arguments_a_class_takes_through_kwargs_are_not_second_guessed():
    assert env_problems("env.id", "kvrl.data.self_distill:SelfDistilledEnv", "env.kwargs", {"path": "x"}) == []
    missing = env_problems("env.id", "kvrl.data.self_distill:SelfDistilledEnv", "env.kwargs", {})
    assert missing == [
        "env.kwargs.path is required by kvrl.data.self_distill:SelfDistilledEnv (its arguments: "
        "path, env, env_kwargs); set env.kwargs.path=..."
    ]
    assert "cannot be imported" in env_problems("env.id", "no_such_pkg.envs:Env", "env.kwargs", {})[0]


def test_a_type_hint_is_valid_for_the_job(monkeypatch):
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"set e\.g\. sampling\.temperature=2\.5$"):
        load_config(["recipe=tiny_rl_full", "sampling.temperature=hot"])
