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
