"""What is refused at run start, before an engine, an actor or the job starts: vLLM bf16 on an AMX
CPU, sizes this machine cannot hold, a seed no generator takes, a budget no sequence outgrows,
data set rows the model cannot hold or that are not UTF-8, an env path to anything but an env
class, an empty output dir, a logger not installed; and the suggested KV settings pass every
KV rule. A run folder reached through a symlink, or copied, continues as documented.
"""

import json
from pathlib import Path

import pytest
from gate_cases import SMALL_PRETRAIN

from kvrl.config import ConfigError, load_config
from kvrl.preflight.machine import run_problems
from kvrl.run import main


@pytest.mark.parametrize(
    "amx, dtype, refused", [(True, "bfloat16", True), (True, "float32", False), (False, "bfloat16", False)]
)
def test_vllm_bf16_on_an_amx_cpu_is_refused_before_the_engine_starts(monkeypatch, amx, dtype, refused):
    """vLLM's CPU attention stores a bf16 cache in its AMX layout where the CPU has AMX; kvrl's
    eviction cannot read that layout, so the gate refuses the combination with the fix."""
    import torch

    from kvrl.preflight.machine import machine_problems

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cfg = load_config(
        ["recipe=tiny_rl_full", "workers.engine=vllm", "sampling.temperature=1.0", f"model.dtype={dtype}"]
    )
    problems = [p for p in machine_problems(cfg, ray=True) if "AMX" in p]
    assert bool(problems) == refused
    if refused:
        assert "set model.dtype=float32" in problems[0]


@pytest.mark.parametrize(
    "override, refused",
    [([], False), (["sampling.batch_size=1000000000"], True), (["trainer.batch_size=1000000000000"], True)],
)
def test_sizes_this_machine_cannot_hold_are_refused_before_any_actor_starts(monkeypatch, override, refused):
    """sampling.batch_size=10**9 used to dry-run to a 217,437 GiB KV estimate and start; a huge
    trainer.batch_size climbed in memory until killed. The gate compares the plan's estimate of
    the local Ray's CPU actors with this machine's memory."""
    from kvrl.preflight.machine import machine_problems

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    cfg = load_config(["recipe=tiny_rl_full", *override])
    problems = [p for p in machine_problems(cfg, ray=True) if "CPU actors need" in p]
    assert bool(problems) == refused
    if refused:
        assert "lower sampling.batch_size" in problems[0] and "dry_run=true shows the estimate" in problems[0]


def test_a_seed_no_generator_takes_is_refused_by_the_config(monkeypatch):
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"seed must be in \[0, 2\*\*32\) \(got 99999999999999999999\); set seed=0"):
        load_config(["recipe=tiny_rl_full", "seed=99999999999999999999"])


@pytest.mark.parametrize(
    "kv",
    [
        ["kv.window=100000", "kv.budget=100020"],  # before: "set kv.budget=100005 (below 1024)"
        ["kv.window=100000", "kv.budget=50"],  # before: "set kv.budget=100005 (or lower kv.window / kv.sink)"
        ["kv.window=100000", "kv.budget=0"],
        ["kv.sink=5000", "kv.budget=0"],
        ["kv.window=900", "kv.sink=200", "kv.budget=2000"],
        ["kv.window=40", "kv.budget=0", "kv.interval=1000"],
        ["kv.budget=2000"],
    ],
)
def test_the_suggested_kv_settings_pass_every_kv_rule(monkeypatch, kv):
    """Whatever kv.budget the refusal suggests (with kv.window / kv.sink when no budget fits beside them) is
    accepted when given back: a budget at least kv.window + kv.sink + 1 and below the 1024 positions."""
    import re

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    with pytest.raises(ConfigError) as refused:
        load_config(["recipe=tiny_multihop_sparse", *kv])
    fix = re.search(r"; set ((?:kv\.\w+=\d+ ?)+)", str(refused.value))
    assert fix is not None, str(refused.value)
    load_config(["recipe=tiny_multihop_sparse", *kv, *fix.group(1).split()])


@pytest.mark.parametrize("data", [False, True], ids=["procedural", "data_set"])
def test_a_budget_no_sequence_outgrows_is_refused_at_run_start(tmp_path, monkeypatch, capsys, data):
    """What only the prompts tell: kv.budget >= the longest prompt + sampling.max_new_tokens
    would run RL-Sparse on the full cache. The run stops with exit 2 before Ray starts or output_dir is made."""
    import ray

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "run"
    argv = ["recipe=tiny_gkv_sparse", f"output_dir={out}", "kv.budget=500"]
    if data:  # three short problems: the recipe's own budget (76) outlasts every sequence
        path = tmp_path / "problems.jsonl"
        path.write_text(
            "".join(json.dumps({"question": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n" for i in range(3))
        )
        # the bare question: the tiny reasoner's tokenizer reads no English instruction
        argv = argv[:2] + ["env.id=kvrl/math-v0", f"env.kwargs.path={path}", "env.kwargs.template='{question}'"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    budget = 76 if data else 500
    whence = (
        "the longest prompt of env.id=kvrl/math-v0's data set"
        if data
        else "the longest of 256 prompts drawn from env.id=kvrl/counts-v0"
    )
    assert err.startswith(
        f"kvrl: error: the run cannot start: kv.budget={budget} never evicts: a sequence holds at most "
    ), err
    assert whence in err and "sampling.max_new_tokens=64" in err and "rl.algo=rl_sparse" in err, err
    limit = int(err.split("holds at most ")[1].split()[0])
    assert limit < budget + 1 and f"set kv.budget={max(13, limit // 2)} (below {limit})" in err, err
    assert not ray.is_initialized() and not out.exists()


def test_a_data_set_row_the_model_cannot_hold_is_refused_at_run_start(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    path = tmp_path / "problems.jsonl"
    path.write_text(
        json.dumps({"question": "1 + 1 = ?", "answer": "2"})
        + "\n"
        + json.dumps({"question": " ".join(["3"] * 40), "answer": "3"})
        + "\n"
    )
    assert (
        main(
            [
                "recipe=tiny_rl_full",
                "env.id=kvrl/math-v0",
                f"env.kwargs.path={path}",
                "model.max_model_len=32",
                "env.kwargs.template='{question}'",
                f"output_dir={tmp_path / 'run'}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "the run cannot start: " in err and "problems.jsonl:2: the prompt has" in err, err
    assert "the model holds 32 positions; drop or shorten that row" in err and "Traceback" not in err, err


def test_a_data_set_row_that_is_not_utf8_is_refused_at_run_start(tmp_path, monkeypatch, capsys):
    """A lone surrogate (JSON's "\\ud800") in a row. Before: the row's ValueError as a traceback (exit 1)."""
    import ray

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = tmp_path / "problems.jsonl"
    path.write_text('{"question": "1 + 1 = ?", "answer": "2"}\n{"question": "1 + \\ud800 = ?", "answer": "3"}\n')
    out = tmp_path / "run"
    env = ["env.id=kvrl/math-v0", f"env.kwargs.path={path}", "env.kwargs.template='{question}'"]
    assert main(["recipe=tiny_rl_full", f"output_dir={out}", *env]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"kvrl: error: the run cannot start: env.id=kvrl/math-v0: {path}:2: the question holds a lone surrogate "
        "'\\ud800' at character 5"
    ), err
    assert "Traceback" not in err and not ray.is_initialized() and not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["recipe=tiny_rl_full", "env.id=os:system", "env.kwargs.command=touch {marker}", "dry_run=true"],
        ["recipe=tiny_rl_full", "env.id=os:system", "env.kwargs.command=touch {marker}"],
        [
            "recipe=tiny_self_distill",
            "self_distill.source=os:system",
            "self_distill.source_kwargs.command=touch {marker}",
        ],
    ],
    ids=["env_dry_run", "env_run", "self_distill_source"],
)
def test_an_env_path_to_anything_but_an_env_class_is_refused_before_it_is_called(tmp_path, monkeypatch, capsys, argv):
    """env.id=os:system with env.kwargs.command: the gate read the signature, found `command`, passed it, and the
    dry run's plan called os.system. A dotted path must name an Env class, refused before anything is called."""
    from kvrl.envs import make

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    marker = tmp_path / "PWNED"
    argv = [a.replace("{marker}", str(marker)) for a in argv] + [f"output_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    key = "self_distill.source" if "source" in argv[1] else "env.id"
    assert (
        f"{key}='os:system' cannot be used: 'os:system' is a builtin_function_or_method, not a kvrl.envs.Env "
        "class" in err
    ), err
    assert "Traceback" not in err and not marker.exists() and not (tmp_path / "run").exists()
    with pytest.raises(TypeError, match="not a kvrl.envs.Env class"):
        make("os:system", command=f"touch {marker}")
    assert not marker.exists()


@pytest.mark.parametrize("dry_run", ["true", "false"])
def test_an_empty_output_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, dry_run):
    """`output_dir=` wrote checkpoints/, model/, metrics.jsonl and .lock into the current directory."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["recipe=tiny_rl_full", "output_dir=", f"dry_run={dry_run}"]) == 2
    err = capsys.readouterr().err
    assert "output_dir must name a folder (empty would write the run into the current directory) (got '')" in err
    assert "set output_dir=outputs/${run_name}" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key, package", [("logging.tensorboard", "tensorboard"), ("logging.wandb", "wandb")])
def test_a_logger_that_is_not_installed_is_refused_before_the_run_starts(tmp_path, monkeypatch, key, package):
    """logging.tensorboard=true without tensorboard was an ImportError after Ray and the actors had started."""
    import sys

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.setitem(sys.modules, package, None)  # what an interpreter without the package finds
    cfg = load_config(["recipe=tiny_rl_full", f"{key}=true", f"output_dir={tmp_path / 'run'}"])
    assert (
        f"{key}=true needs the {package} package, which is not installed here: pip install {package}, or set "
        f"{key}=false" in "\n".join(run_problems(cfg))
    )
    cfg = load_config(["recipe=tiny_rl_full", f"{key}=false", f"output_dir={tmp_path / 'run'}"])
    assert package not in "\n".join(run_problems(cfg))


def test_a_run_folder_reached_through_a_symlink_or_copied_continues_as_documented(tmp_path, monkeypatch, capsys):
    """Resume through a symlink to the run folder, or from a copied run folder, was refused because output_dir
    differed, with a fix pointing at the original. A symlink is the same folder; a copy continues with
    resume=<its checkpoint>, which the refusal names; the original folder is only read."""
    import shutil

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    args = SMALL_PRETRAIN
    real = tmp_path / "real"
    assert main([*args, f"output_dir={real}", "trainer.steps=2"]) == 0  # step_000001 (the last step: model/ only)
    copy = Path(shutil.copytree(real, tmp_path / "copy", symlinks=True))
    link = tmp_path / "link"
    link.symlink_to(real)
    capsys.readouterr()
    assert main([*args, f"output_dir={link}", "trainer.steps=3"]) == 0
    assert "resumed from" in capsys.readouterr().out
    before = {p: p.read_bytes() for p in real.rglob("*") if p.is_file()}
    assert main([*args, f"output_dir={copy}", "trainer.steps=4"]) == 2
    err = capsys.readouterr().err
    checkpoint = copy / "checkpoints" / "step_000001"
    assert (
        f"output_dir: '{real}' -> '{copy}' (this folder holds a run written as output_dir={real}: copied or moved "
        f"here; to continue it here, set resume={checkpoint}, which continues that checkpoint" in err
    ), err
    assert main([*args, f"output_dir={copy}", "trainer.steps=4", f"resume={checkpoint}"]) == 0
    assert "resumed from" in capsys.readouterr().out and (copy / "checkpoints" / "step_000003").is_dir()
    assert {p: p.read_bytes() for p in real.rglob("*") if p.is_file()} == before  # the original is untouched
