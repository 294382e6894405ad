"""Config sections owned by what they configure: an algorithm of your own brings its keys and
rules without a change to kvrl/config (one line in kvrl.algos.ALGOS, or none: rl.algo=pkg.module:Class),
and kv.policy takes a KVPolicy class of your own by path.

Everything here is defined in this file: the toy algorithms, their sections and rules, and the policy."""

import re
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import yaml

from kvrl.algos import ALGOS, Algo, make_algo
from kvrl.algos.rl_sparse import RLSparse
from kvrl.config import ConfigError, load_config, schema_keys
from kvrl.policies import KVPolicy, make_policy
from kvrl.run import main
from kvrl.section import SECTIONS, checked, register_section

# --- a toy algorithm with its own section and rule -------------------------------------------------


@dataclass
class ToyConfig:
    rounds: int = checked(2, ge=1)  # inner rounds per RL step
    shrink: float = 0.5


def toy_problems(cfg) -> list[str]:
    if cfg.toy.rounds > cfg.trainer.steps:
        return [
            f"toy.rounds ({cfg.toy.rounds}) must be <= trainer.steps ({cfg.trainer.steps}): a round is a "
            f"step's; set toy.rounds={cfg.trainer.steps}"
        ]
    return []


class Toy:  # what ALGOS names; these tests never build it
    def __init__(self, cfg):
        self.cfg = cfg


@pytest.fixture
def toy(monkeypatch):
    """An algorithm added to kvrl: its one line in ALGOS (class, config module, job: rl by default), and the
    section its config module registers when imported (here, in the fixture, so that it can be undone)."""
    monkeypatch.setitem(ALGOS, "toy", Algo(f"{__name__}:Toy"))
    saved = dict(SECTIONS)
    register_section("toy", ToyConfig, toy_problems)
    yield
    SECTIONS.clear()
    SECTIONS.update(saved)


TOY = ["recipe=tiny_rl_full", "rl.algo=toy"]


def test_a_new_section_is_read_from_the_command_line(toy, capsys):
    assert main([*TOY, "toy.rounds=3", "print_config=true"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["toy"] == {"rounds": 3, "shrink": 0.5} and printed["rl"]["algo"] == "toy"
    cfg = load_config([*TOY, "toy.shrink=0.25"])
    assert cfg.toy == ToyConfig(rounds=2, shrink=0.25)
    assert main(["--help"]) == 0 and "toy.rounds=2" in capsys.readouterr().out


def test_a_typo_in_a_new_section_names_the_key(toy, capsys):
    assert main([*TOY, "toy.ruonds=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrl: error: ") and "unknown key toy.ruonds; did you mean toy.rounds?" in err
    assert main([*TOY, "toy.rounds=abc"]) == 2
    assert "toy.rounds expects int, got 'abc'; set e.g. toy.rounds=2" in capsys.readouterr().err
    assert main([*TOY, "toy.rounds=0"]) == 2  # the range rule beside the field
    assert "toy.rounds must be >= 1 (got 0); set toy.rounds=2" in capsys.readouterr().err


def test_a_new_rule_fires_with_its_fix(toy, capsys):
    steps = load_config(TOY).trainer.steps
    assert main([*TOY, f"toy.rounds={steps + 1}"]) == 2
    err = capsys.readouterr().err
    assert f"toy.rounds ({steps + 1}) must be <= trainer.steps ({steps})" in err and f"set toy.rounds={steps}" in err
    # the rule is the algorithm's: another rl.algo does not run it, and another job does not run the algorithm
    load_config(["recipe=tiny_rl_full", f"toy.rounds={steps + 1}"])
    with pytest.raises(ConfigError, match="job=rlkv runs rl.algo=rlkv, not rl.algo=toy; set job=rl"):
        load_config(["recipe=tiny_rlkv", "rl.algo=toy"])


def test_without_the_registration_the_key_is_unknown():
    assert "toy" not in SECTIONS and "toy.rounds" not in schema_keys()
    with pytest.raises(ConfigError, match="unknown key toy;"):
        load_config(["recipe=tiny_rl_full", "toy.rounds=3"])


# --- rl.algo=pkg.module:Class: an algorithm outside kvrl, no line in kvrl at all ------------------

# a user's module: importing it registers its section (the config loader imports it before the schema)
BOOST = """
from dataclasses import dataclass

from kvrl.algos.rl_full import RLFull
from kvrl.section import checked, register_section


@dataclass
class BoostConfig:
    factor: float = checked(2.0, lambda v: v > 0, "must be > 0")


def problems(cfg):
    if cfg.boost.factor > cfg.trainer.steps:
        return [f"boost.factor ({cfg.boost.factor}) must be <= trainer.steps; set boost.factor=2.0"]
    return []


register_section("boost", BoostConfig, problems)


class Boost(RLFull):
    section = "boost"


class Unregistered(RLFull):
    section = "nowhere"


class NotAnAlgorithm:
    pass
"""


@pytest.fixture
def boost(tmp_path, monkeypatch):
    """`my_algos` on the path, not imported yet; afterwards kvrl's sections are as they were."""
    (tmp_path / "my_algos.py").write_text(BOOST)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_algos", raising=False)
    saved = dict(SECTIONS)
    yield
    SECTIONS.clear()
    SECTIONS.update(saved)
    sys.modules.pop("my_algos", None)


def test_an_algorithm_by_path_brings_its_section(boost, capsys):
    assert "boost" not in SECTIONS
    assert main(["recipe=tiny_rl_full", "rl.algo=my_algos:Boost", "boost.factor=3", "print_config=true"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["boost"] == {"factor": 3.0} and printed["rl"]["algo"] == "my_algos:Boost"
    cfg = load_config(["recipe=tiny_rl_full", "rl.algo=my_algos:Boost"])
    algo = make_algo(cfg)
    assert type(algo).__name__ == "Boost" and algo.cfg.boost.factor == 2.0
    # its rules run with the job's; the range rule beside the field too
    assert main(["recipe=tiny_rl_full", "rl.algo=my_algos:Boost", "boost.factor=1000"]) == 2
    assert "boost.factor (1000.0) must be <= trainer.steps; set boost.factor=2.0" in capsys.readouterr().err
    assert main(["recipe=tiny_rl_full", "rl.algo=my_algos:Boost", "boost.factor=0"]) == 2
    assert "boost.factor must be > 0 (got 0.0); set boost.factor=2.0" in capsys.readouterr().err
    # the job the config names runs it: rl_full's own rule (kv.policy=full) does not apply, the shared ones do
    assert main(["recipe=tiny_rl_full", "rl.algo=my_algos:Boost", "trainer.batch_size=12"]) == 2
    assert "trainer.batch_size (12) must be a multiple of rl.group_size (8)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "algo, message",
    [
        ("my_algos:Bost", "rl.algo='my_algos:Bost' cannot be imported (module 'my_algos' has no attribute 'Bost'"),
        (
            "no_such_pkg.algos:RLFul",
            "rl.algo='no_such_pkg.algos:RLFul' cannot be imported (No module named "
            "'no_such_pkg'); set rl.algo=rl_full (registered: rl_full,",
        ),
        ("my_algos:NotAnAlgorithm", "rl.algo='my_algos:NotAnAlgorithm' is not a subclass of kvrl.algos.base.Algorithm"),
        ("my_algos:Unregistered", "rl.algo=my_algos:Unregistered names section 'nowhere', which nothing registered"),
        ("rl_ful", "unknown rl.algo 'rl_ful'; set rl.algo=rl_full"),
    ],
)
def test_a_bad_algorithm_names_the_fix(boost, capsys, algo, message):
    assert main(["recipe=tiny_rl_full", f"rl.algo={algo}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrl: error: ") and message in err, err


def test_a_registered_algorithm_runs_under_its_job_only():
    with pytest.raises(
        ConfigError,
        match=re.escape("job=rl runs rl.algo=rl_full | rl_sparse | distill, not rl.algo=rlkv; set job=rlkv"),
    ):
        load_config(["recipe=tiny_rl_full", "rl.algo=rlkv"])
    with pytest.raises(ConfigError, match="not rl.algo=foresight; set job=foresight"):
        load_config(["recipe=tiny_rl_full", "rl.algo=foresight"])


# --- kv.policy=pkg.module:Class, as env.id=pkg.module:Class ---------------------------------------


@dataclass(kw_only=True)
class Oldest(KVPolicy):
    """Keeps the oldest tokens beyond the sink and window (or the newest, `newest=True`)."""

    newest: bool = False
    reads: ClassVar[frozenset[str]] = frozenset()

    def score(self, obs):
        pos = obs.key_pos.float()
        return (pos if self.newest else -pos), None


class NotAPolicy:
    def __init__(self, budget=0):
        self.budget = budget


def test_kv_policy_takes_a_class_by_path():
    cfg = load_config(["recipe=tiny_gkv_sparse", f"kv.policy={__name__}:Oldest", "kv.kwargs.newest=true"])
    assert cfg.kv.policy == f"{__name__}:Oldest" and cfg.kv.kwargs == {"newest": True}  # the gkv kwargs dropped
    policy = RLSparse(cfg).rollout_policy(SimpleNamespace(config=None)).policy  # the rollouts' policy
    assert type(policy) is Oldest and policy.newest and policy.budget == cfg.kv.budget
    assert policy.window == cfg.kv.window and policy.sink == cfg.kv.sink
    assert type(make_policy(f"{__name__}:Oldest", budget=32)) is Oldest


@pytest.mark.parametrize(
    "args, message",
    [
        ([f"kv.policy={__name__}:Oldst"], f"kv.policy='{__name__}:Oldst' cannot be used"),
        (["kv.policy=no_such_module:Oldest"], "No module named 'no_such_module'"),
        ([f"kv.policy={__name__}:NotAPolicy"], "is not a KVPolicy subclass"),
        (
            [f"kv.policy={__name__}:Oldest", "kv.kwargs.newset=true"],
            f"kv.kwargs.newset is not an argument of {__name__}:Oldest (did you mean kv.kwargs.newest?)",
        ),
    ],
)
def test_a_bad_policy_path_names_the_fix(capsys, args, message):
    assert main(["recipe=tiny_gkv_sparse", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrl: error: ") and message in err, err
    fix = "its arguments: budget" if "kv.kwargs" in message else "set kv.policy to a policy name (gkv, h2o, snapkv"
    assert fix in err, err
