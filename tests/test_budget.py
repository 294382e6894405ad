"""The KV budget's rules (kvrl.budget) are what every check of a budget applies: a policy built in
Python, the kv section on the config path, job=eval's lines and the engines' warning agree with them."""

import warnings

import pytest

from kvrl.budget import budget_evicts, least_budget
from kvrl.config import ConfigError, load_config
from kvrl.engines.base import Sampling, check_request
from kvrl.policies import Evicting, make_policy

GEOMETRIES = [(8, 4), (1, 0), (16, 40)]  # (window, sink)


def kv_args(window: int, sink: int, budget: int) -> list[str]:
    """RL-Sparse on the multihop reasoner, at most 256 tokens a sequence."""
    return [
        "recipe=tiny_multihop_sparse",
        "model.max_model_len=256",
        f"kv.window={window}",
        f"kv.sink={sink}",
        f"kv.budget={budget}",
    ]


def test_the_rules():
    assert least_budget(window=8, sink=4) == 13
    assert budget_evicts(255, 256) and not budget_evicts(256, 256) and not budget_evicts(300, 256)
    assert budget_evicts(10**9, float("inf"))  # a sequence of unknown length may outgrow any budget


@pytest.mark.parametrize("window, sink", GEOMETRIES)
def test_a_policy_and_the_kv_section_start_at_the_least_budget(window, sink):
    least = least_budget(window, sink)
    make_policy("h2o", budget=least, window=window, sink=sink)
    with pytest.raises(ValueError, match=f"must be ≥ window \\+ sink \\+ 1 = {least} "):
        make_policy("h2o", budget=least - 1, window=window, sink=sink)
    load_config(kv_args(window, sink, least))
    with pytest.raises(ConfigError, match=f"kv.budget must be >= kv.window \\+ kv.sink \\+ 1 = {least} "):
        load_config(kv_args(window, sink, least - 1))


def test_the_kv_section_and_the_engines_refuse_the_budget_a_sequence_reaches():
    load_config(kv_args(8, 4, 255))
    with pytest.raises(ConfigError, match="kv.budget=256 never evicts: a sequence holds at most 256 tokens"):
        load_config(kv_args(8, 4, 256))
    prompts, sampling = [200, 56], Sampling(max_new_tokens=56)  # the longest sequence: 256 tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_request(prompts, sampling, Evicting(make_policy("h2o", budget=255)), positions=1024)
    with pytest.warns(UserWarning, match="kv budget 256 >= the longest sequence"):
        check_request(prompts, sampling, Evicting(make_policy("h2o", budget=256)), positions=1024)


def test_job_eval_drops_the_budgets_a_sequence_reaches():
    load_config(["recipe=tiny_eval", "model.max_model_len=256", "eval.budgets=[0.5,255]"])
    with pytest.raises(ConfigError, match="eval.budgets 256 never evict"):
        load_config(["recipe=tiny_eval", "model.max_model_len=256", "eval.budgets=[0.5,255,256]"])
