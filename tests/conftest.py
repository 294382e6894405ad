"""Test-wide settings for a 2-core CPU machine.

One torch thread: two threads fighting other processes over 2 cores made tiny-model
forwards ~100x slower. Flushing denormals: float32 training on CPU slows down several-fold
once small gradients and Adam moments go subnormal.
"""

import torch

torch.set_num_threads(1)
torch.set_flush_denormal(True)
