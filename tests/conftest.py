"""Test-wide settings for a 2-core CPU machine.

One torch thread: two threads fighting other processes over 2 cores made tiny-model
forwards ~100x slower. Flushing denormals: float32 training on CPU slows down several-fold
once small gradients and Adam moments go subnormal.
"""

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from kvrl.engines.hf import HFEngine
from kvrl.models.tiny import build_tokenizer, tiny_config

torch.set_num_threads(1)
torch.set_flush_denormal(True)


@pytest.fixture(scope="module")
def engine():
    """HF engine over a random-init tiny reasoner (one per test module)."""
    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = tiny_config(tok)
    cfg.initializer_range = 0.05  # peakier attention than the default 0.02: scores far from ties
    return HFEngine(LlamaForCausalLM(cfg).eval(), tok)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    """The folder of a random-init tiny Llama and its tokenizer (one per test module)."""
    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    tok = build_tokenizer()
    LlamaForCausalLM(tiny_config(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The folder of the random-init tiny reasoner of ``engine`` (peakier attention), saved for
    engines that load a path (one per test module)."""
    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = tiny_config(tok)
    cfg.initializer_range = 0.05  # peakier attention: scores far from ties (as test_hf_engine)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@contextmanager
def private_ray(tmp_path_factory, **init):
    """A private 2-CPU Ray on this machine, shut down on exit. Its temp dir comes from
    ``tmp_path_factory``: short, as Ray's socket paths must stay <= 107 bytes."""
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 1024**2,
        log_to_driver=False,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        **init,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def local_ray(tmp_path_factory):
    """A private 2-CPU Ray for one test: a recipe run as shipped."""
    with private_ray(tmp_path_factory):
        yield


@pytest.fixture(scope="module")
def module_ray(tmp_path_factory):
    """A private 2-CPU Ray for the whole module, whose actors can import the test modules: the
    environments a test module defines are named by dotted path and scored on the actors (as
    ``launch/ray_submit.sh`` uploads a job's working dir)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    with private_ray(tmp_path_factory, runtime_env={"env_vars": {"PYTHONPATH": path}}):
        yield


USER_PACKAGE = {
    "__init__.py": '"""A user\'s task package outside kvrl: importing it registers its ids."""\n'
    "from kvrl.envs import register\n\n"
    'register("kvtasks/partial-counts-v0", "kvtasks.envs:PartialCountsEnv", n_digits=8)\n',
    "envs.py": '"""Counts with a metric of the user\'s own, which shows in metrics.jsonl as env/user_words."""\n'
    "from kvrl.envs import Reward\nfrom kvrl.envs.base import correct\n"
    "from kvrl.envs.counts import CountsEnv\n\n\n"
    "def words(task, completion):\n    return float(len(completion.split()))\n\n\n"
    "class PartialCountsEnv(CountsEnv):\n"
    "    def __init__(self, n_digits: int = 24):\n"
    "        super().__init__(n_digits=n_digits)\n"
    '        self.rewards = [Reward(correct, 1.0, "correct"), Reward(words, 0.0, "user_words")]\n',
}


@pytest.fixture
def user_package(tmp_path):
    """A package `kvtasks` in a folder of its own (nothing installed) that registers
    `kvtasks/partial-counts-v0`: the folder to put on PYTHONPATH, or ship as a py_module."""
    root = tmp_path / "user_src"
    (root / "kvtasks").mkdir(parents=True)
    for name, text in USER_PACKAGE.items():
        (root / "kvtasks" / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def tiny():
    """The shipped tiny reasoner, frozen: (model, tokenizer)."""
    from kvrl.models.tiny import load_model

    model, tok = load_model("tiny")
    model.requires_grad_(False)
    return model, tok
