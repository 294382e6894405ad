"""The specification of kvrl's kernels, in torch: what every op computes (see
:mod:`kvrl.kernels`). It imports nothing of the accelerators; they are tested against it.
"""

import torch

NEVER = torch.iinfo(torch.int32).max  # the death time of a key that is never evicted
