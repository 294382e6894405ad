"""The algorithm contract is declared in code: the base class names its hooks and their signatures,
every shipped algorithm defines them, and RL-Sparse builds on RL-Full's constructor."""

import importlib

import pytest

from kvrl.algos import ALGOS
from kvrl.algos.base import Algorithm
from kvrl.algos.rl_full import RLFull
from kvrl.algos.rl_sparse import RLSparse
from kvrl.config import load_config

HOOKS = ("setup", "loss", "state", "load")


def shipped() -> dict[str, type]:
    return {
        name: getattr(importlib.import_module(a.entry.partition(":")[0]), a.entry.partition(":")[2])
        for name, a in ALGOS.items()
    }


def test_every_shipped_algorithm_defines_the_hooks_the_base_declares():
    assert all(callable(getattr(Algorithm, hook)) for hook in HOOKS)
    missing = [
        (name, hook)
        for name, cls in shipped().items()
        for hook in HOOKS
        if getattr(cls, hook) is getattr(Algorithm, hook)
    ]
    assert not missing, f"algorithms that inherit a hook they must define: {missing}"


def test_a_hook_left_undefined_says_which():
    class Half(Algorithm):
        def setup(self, model, tokenizer):
            return []

    algo = Half(cfg=None)
    assert algo.setup(None, None) == []
    with pytest.raises(NotImplementedError, match=r"Half must define loss\(engine, batch\)"):
        algo.loss(None, None)


def test_rl_sparse_builds_on_rl_fulls_constructor(monkeypatch):
    built = []
    original = RLFull.__init__

    def recording(self, cfg):
        built.append(type(self).__name__)
        original(self, cfg)

    monkeypatch.setattr(RLFull, "__init__", recording)
    cfg = load_config(["recipe=tiny_gkv_sparse"])
    algo = RLSparse(cfg)
    assert built == ["RLSparse"]
    assert (algo.rl, algo.temperature, algo.ref, algo.kv) == (cfg.rl, cfg.sampling.temperature, None, cfg.kv)
