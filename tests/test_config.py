"""Config loading and the `python -m kvrl.run` front door: every mistake exits 2 with the fix."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from gate_cases import SMALL_PRETRAIN

from kvrl.config import Config, ConfigError, available_recipes, load_config, recipes_dir
from kvrl.run import JOBS, main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def repo_recipes(monkeypatch):
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVRL_RECIPES_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "kvrl.run", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


# --- the real entry point (subprocess: exit status and output streams) ---


def test_unknown_recipe_exits_2_and_lists_recipes():
    proc = run_module("recipe=nope")
    assert proc.returncode == 2
    assert "unknown recipe 'nope'" in proc.stderr
    assert "tiny_eval" in proc.stderr and "tiny_pretrain" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_print_config_exits_0_with_yaml():
    proc = run_module("recipe=tiny_pretrain", "print_config=true", "trainer.lr=1e-3")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    recipe = yaml.safe_load((recipes_dir() / "tiny_pretrain.yaml").read_text())
    assert printed["trainer"]["lr"] == 1e-3  # the command line wins over the recipe
    assert printed["trainer"]["steps"] == recipe["trainer"]["steps"]  # the recipe wins over the schema
    assert printed["output_dir"] == "outputs/tiny_pretrain"  # interpolations are resolved


def test_no_heavy_import_before_the_config_is_valid():
    script = (
        "import sys; from kvrl.run import main\n"
        "assert main(['trainer.lrr=1']) == 2\n"
        "assert main(['print_config=true']) == 0\n"
        "heavy = {'torch', 'transformers', 'ray'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# --- in-process ---


def test_mistyped_key_names_the_nearest_valid_key(capsys):
    assert main(["trainer.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key trainer.lrr" in err and "did you mean trainer.lr?" in err


@pytest.mark.parametrize(
    "arg, key, expected, given",
    [
        ("trainer.lr=abc", "trainer.lr", "float", "'abc'"),
        ("kv.budget=1.5", "kv.budget", "int", "1.5"),
    ],
)
def test_wrong_type_names_key_type_and_value(capsys, arg, key, expected, given):
    assert main([arg]) == 2
    err = capsys.readouterr().err
    assert f"{key} expects {expected}, got {given}" in err


def test_an_empty_value_is_the_empty_string_where_a_string_is_expected(capsys):
    """`workers.address=` (OmegaConf reads null) is '' for a string key, as the user typed, and the
    fix an error proposes for one is typeable; an empty number is still refused."""
    assert load_config(["recipe=tiny_rl_full", "workers.address=auto", "workers.address="]).workers.address == ""
    assert main(["kv.budget="]) == 2
    assert "kv.budget expects int, got None" in capsys.readouterr().err


def test_malformed_argument_shows_the_syntax(capsys):
    assert main(["trainer.lr", "0.1"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_unknown_job_lists_the_jobs(capsys):
    assert main(["job=evl"]) == 2
    err = capsys.readouterr().err
    assert "did you mean job=eval?" in err and all(job in err for job in JOBS)


def test_help_lists_recipes_jobs_and_keys(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "tiny_eval" in out and "tiny_pretrain" in out
    assert "Train the embedded tiny reasoner (model.path=tiny) from scratch" in out  # first comment line
    assert "pretrain_tiny" in out and "trainer.lr=0.003" in out and "eval.budgets=[0.25,0.5]" in out


def test_version_prints_the_package_version(capsys):
    """`python -m kvrl.run --version` (and the `kvrl` script, the same main) prints kvrl.__version__, the one
    version setup.cfg reads too, and starts nothing."""
    import configparser

    import kvrl

    assert main(["--version", "recipe=nope"]) == 0
    assert capsys.readouterr().out == f"kvrl {kvrl.__version__}\n"
    proc = run_module("--version")
    assert proc.returncode == 0 and proc.stdout == f"kvrl {kvrl.__version__}\n", proc.stderr
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    assert setup["metadata"]["version"] == "attr: kvrl.__version__"


def test_printed_config_round_trips_as_a_recipe(capsys, tmp_path, monkeypatch):
    assert main(["print_config=true", "kv.budget=64", "env.kwargs.n_digits=12"]) == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["kv"]["budget"] == 64
    original = load_config(["kv.budget=64", "env.kwargs.n_digits=12"])
    (tmp_path / "again.yaml").write_text(printed)
    monkeypatch.setenv("KVRL_RECIPES_DIR", str(tmp_path))
    again = load_config(["recipe=again", "print_config=false"])
    assert dataclasses.replace(again, recipe="tiny_foresight") == original


def test_unknown_key_in_a_recipe_names_file_and_key(capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("# a recipe with a typo\njob: eval\ntrainer:\n  lrr: 0.1\n")
    monkeypatch.setenv("KVRL_RECIPES_DIR", str(tmp_path))
    assert main(["recipe=bad"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "trainer.lrr" in err and "did you mean trainer.lr?" in err


def test_validation_messages_say_the_fix():
    with pytest.raises(ConfigError) as info:
        load_config(["kv.interval=0", "model.dtype=float64"])
    message = str(info.value)
    assert "kv.interval must be >= 1 (got 0); set kv.interval=16" in message
    assert "model.dtype must be one of float32 | bfloat16 | float16 (got 'float64')" in message


def test_the_non_finite_update_limit_is_validated_and_resumable():
    with pytest.raises(
        ConfigError,
        match=r"trainer.max_nonfinite_steps must be >= 1 \(got 0\); set "
        r"trainer.max_nonfinite_steps=3",
    ):
        load_config(["recipe=tiny_rl_full", "trainer.max_nonfinite_steps=0"])
    assert "trainer.max_nonfinite_steps" in Config.RESUMABLE  # raise it and resume=auto a run it stopped


def test_budget_ratio_is_a_fraction_and_refused_where_the_budget_is_fixed():
    assert load_config(["recipe=tiny_gkv_sparse", "kv.budget_ratio=0.25"]).kv.budget_ratio == 0.25
    assert load_config(["recipe=tiny_eval", "kv.budget_ratio=0.2", "eval.policies=[gkv,rkv]"]).kv.budget_ratio == 0.2
    cases = [
        (
            ["recipe=tiny_gkv_sparse", "kv.budget_ratio=1.5"],
            "kv.budget_ratio must be null (a fixed budget) or a fraction in (0, 1] (got 1.5); set kv.budget_ratio=null",
        ),
        (["recipe=tiny_gkv_sparse", "kv.kwargs.budget_ratio=0.2"], "set kv.budget_ratio=0.2 instead"),
        (["kv.budget_ratio=0.2"], "kv.budget_ratio=0.2: ForesightKV's eviction MDP"),  # the default recipe
        (
            ["recipe=tiny_eval", "kv.budget_ratio=0.2"],
            "eval.policies entry 'window' is a fixed sink + recent window, which has no ratio mode, but "
            "kv.budget_ratio is set",
        ),
        (
            ["recipe=tiny_eval", "eval.settings={w: {policy: window, budget_ratio: 0.2}}", "eval.policies=[w]"],
            "but eval.settings.w.budget_ratio is set",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError) as info:
            load_config(argv)
        assert message in str(info.value), argv


@pytest.mark.parametrize("recipe", sorted(available_recipes()))
def test_every_recipe_loads_and_names_a_known_job(recipe):
    cfg = load_config([f"recipe={recipe}"])
    assert isinstance(cfg, Config) and cfg.recipe == recipe and cfg.job in JOBS


def test_recipe_values_and_cli_overrides():
    cfg = load_config([])  # no recipe: the main job, ForesightKV on the tiny reasoner
    assert (cfg.recipe, cfg.job, cfg.kv.policy, cfg.output_dir) == (
        "tiny_foresight",
        "foresight",
        "learned",
        "outputs/tiny_foresight",
    )
    cfg = load_config(["recipe=tiny_eval"])
    assert (cfg.job, cfg.kv.policy, cfg.eval.budgets) == ("eval", "full", [0.25, 0.5, 0.75])
    cfg = load_config(["recipe=tiny_pretrain", "trainer.steps=10", "run_name=x"])
    assert (cfg.trainer.steps, cfg.trainer.lr, cfg.output_dir) == (10, 3e-3, "outputs/x")


def test_a_check_sits_beside_its_field():
    with pytest.raises(ConfigError, match=r"rl.eps_low must be >= 0 \(got -1.0\); set rl.eps_low=0.2"):
        load_config(["rl.eps_low=-1"])
    # every problem is listed at once, cross-field ones (the job's sections) included
    with pytest.raises(ConfigError) as info:
        load_config(["recipe=tiny_self_distill", "self_distill.counts=[1,2]", "self_distill.candidates=0"])
    assert "self_distill.candidates must be >= 1" in str(info.value)
    assert "self_distill.counts has 2 entries for 3 buckets" in str(info.value)


@pytest.mark.parametrize("old, new", [("rl.beta", "rl.kl_coef"), ("rlkv.beta", "rlkv.l1_coef")])
def test_a_renamed_key_names_the_new_one(capsys, tmp_path, monkeypatch, old, new):
    assert main([f"{old}=0.04"]) == 2
    err = capsys.readouterr().err
    assert f"command line: {old} was renamed {new} (" in err and f"set {new}=0.04" in err
    section, _, leaf = old.partition(".")
    (tmp_path / "old.yaml").write_text(f"job: eval\n{section}:\n  {leaf}: 0.5\n")
    monkeypatch.setenv("KVRL_RECIPES_DIR", str(tmp_path))
    assert main(["recipe=old"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "old.yaml") in err and f"{old} was renamed {new}" in err and f"set {new}=0.5" in err


def test_every_base_is_used_and_is_not_a_recipe():
    bases = {p.stem for p in (recipes_dir() / "base").glob("*.yaml")}
    used = {yaml.safe_load((recipes_dir() / f"{name}.yaml").read_text()).get("base") for name in available_recipes()}
    assert bases and bases <= used, bases - used
    assert not bases & set(available_recipes())


def test_every_recipe_header_names_its_source():
    """A recipe's leading comments name the paper table or setting it reproduces
    (and, in the file or its base, what deliberately differs), or say it reproduces none."""
    for path in sorted(recipes_dir().glob("**/*.yaml")):
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        text = " ".join(header)
        assert "Source:" in text or "reproduc" in text.lower(), f"{path.name}: its header names no source table"


def test_a_recipe_overrides_its_base(capsys, tmp_path, monkeypatch):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "method.yaml").write_text("# shared\njob: eval\nkv:\n  sink: 2\n  window: 3\n")
    (tmp_path / "model.yaml").write_text("# one model\nbase: method\nkv:\n  window: 5\n")
    monkeypatch.setenv("KVRL_RECIPES_DIR", str(tmp_path))
    cfg = load_config(["recipe=model", "kv.sink=1"])
    assert (cfg.job, cfg.kv.sink, cfg.kv.window) == ("eval", 1, 5)  # command line > recipe > base
    assert list(available_recipes()) == ["model"]
    # an unknown base names the available ones; a typo in a base names the base's file
    (tmp_path / "other.yaml").write_text("base: methd\n")
    assert main(["recipe=other"]) == 2
    assert "unknown base 'methd'" in (err := capsys.readouterr().err) and "available bases: method" in err
    (tmp_path / "base" / "method.yaml").write_text("job: eval\nkv:\n  windw: 3\n")
    assert main(["recipe=model"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "base" / "method.yaml") in err and "did you mean kv.window?" in err


@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "base/rl", "..", "tiny_rl_full/../tiny_eval"])
def test_recipe_takes_a_name_never_a_path(name, capsys, tmp_path):
    """Before: recipe=../../x loaded YAML from anywhere under a recipe's name."""
    (tmp_path / "x.yaml").write_text("job: eval\n")
    assert main([f"recipe={name}"]) == 2
    err = capsys.readouterr().err
    assert f"recipe={name} is not a recipe name" in err and "tiny_rl_full" in err
    assert f"load a file of your own with recipe_file={name}" in err


def test_a_recipe_of_your_own_loads_with_recipe_file(tmp_path, capsys):
    own = tmp_path / "mine.yaml"
    own.write_text("# my recipe\njob: eval\ntrainer:\n  steps: 7\n")
    cfg = load_config([f"recipe_file={own}"])
    assert (cfg.recipe, cfg.recipe_file, cfg.run_name, cfg.trainer.steps) == ("mine", str(own), "mine", 7)
    assert main([f"recipe_file={own}", "recipe=tiny_rl_full"]) == 2
    assert "both name the recipe; give one" in capsys.readouterr().err
    assert main([f"recipe_file={tmp_path / 'none.yaml'}"]) == 2
    assert "none.yaml: no such file" in capsys.readouterr().err
    (tmp_path / "escape.yaml").write_text("base: ../../x\njob: rl\n")
    assert main([f"recipe_file={tmp_path / 'escape.yaml'}"]) == 2
    assert "unknown base '../../x'" in capsys.readouterr().err


def test_a_value_from_the_environment_is_never_written_or_shown(monkeypatch, tmp_path, capsys):
    """`${oc.env:...}` gives the job the value; config.json (of a checkpoint), print_config and error
    messages hold the reference. Before: the secret was in every checkpoint's config.json."""
    import json

    from kvrl.jobs.pretrain_tiny import main as pretrain
    from kvrl.runlog import flatten

    secret = "s3cr3t-T0KEN-value"
    monkeypatch.setenv("KVRL_TEST_TOKEN", secret)
    args = [*SMALL_PRETRAIN, "run_name=${oc.env:KVRL_TEST_TOKEN}", f"output_dir={tmp_path}", "trainer.steps=2"]
    cfg = load_config(args)
    assert cfg.run_name == secret  # the job has the value
    assert flatten(cfg)["run_name"] == "${oc.env:KVRL_TEST_TOKEN}"
    pretrain(cfg)
    written = (tmp_path / "checkpoints" / "step_000001" / "config.json").read_text()
    assert secret not in written and json.loads(written)["run_name"] == "${oc.env:KVRL_TEST_TOKEN}"
    monkeypatch.setenv("KVRL_TEST_TOKEN", "a-rotated-token")  # resume compares the references
    capsys.readouterr()
    pretrain(load_config([*args, "trainer.steps=3"]))
    assert "resumed from" in capsys.readouterr().out
    assert main([*args, "print_config=true"]) == 0
    printed = capsys.readouterr().out
    assert "a-rotated-token" not in printed and "run_name: ${oc.env:KVRL_TEST_TOKEN}" in printed
    for bad in ("model.dtype=${oc.env:KVRL_TEST_TOKEN}", "trainer.lr=${oc.env:KVRL_TEST_TOKEN}"):
        assert main(["recipe=tiny_pretrain", bad]) == 2
        err = capsys.readouterr().err
        assert "a-rotated-token" not in err and "${oc.env:KVRL_TEST_TOKEN}" in err, err


@pytest.mark.parametrize("arg", ["job", "recipe", "recipe_file", "device", "workers.address", "output_dir"])
def test_a_value_from_the_environment_is_not_shown_by_any_refusal(monkeypatch, tmp_path, capsys, arg):
    """job=, recipe=, recipe_file=, device= and workers.address= set to `${oc.env:NAME}` printed the value in
    their refusals (read before the recipe, or refused by kvrl.run and the gate after the config loaded)."""
    secret = "s3cr3t-T0KEN-value"
    monkeypatch.setenv("KVRL_TEST_TOKEN", secret)
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    value = f"{tmp_path}/a_file/${{oc.env:KVRL_TEST_TOKEN}}" if arg == "output_dir" else "${oc.env:KVRL_TEST_TOKEN}"
    (tmp_path / "a_file").write_text("")
    argv = [f"{arg}={value}"] + ([] if arg.startswith("recipe") else ["recipe=tiny_rl_full"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert secret not in err and "${oc.env:KVRL_TEST_TOKEN}" in err and "Traceback" not in err, err
