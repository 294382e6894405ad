"""Test-wide settings for a 2-core CPU machine.

One torch thread: two threads fighting other processes over 2 cores made tiny-model
forwards ~100x slower. Flushing denormals: float32 training on CPU slows down several-fold
once small gradients and Adam moments go subnormal.
"""

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
