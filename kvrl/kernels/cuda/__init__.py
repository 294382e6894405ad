"""The GPU kernels of kvrl's ops, in Triton (see :mod:`kvrl.kernels`); each has the signature
of its torch specification in :mod:`kvrl.kernels.reference`. Triton is imported at the
first call, so these modules import on a machine without it.
"""
