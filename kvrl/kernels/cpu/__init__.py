"""The optional C++ CPU accelerator of kvrl's kernels (see :mod:`kvrl.kernels`): ``native.py``
builds ``paged.cpp`` and ``scores.cpp`` on first use (``torch.ops.kvrl_cpu``), and
``paged.py`` and ``scores.py`` wrap them with the signatures of :mod:`kvrl.kernels.reference`.
"""
