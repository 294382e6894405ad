"""kvrl's native CPU ops, built on first use: ``torch.ops.kvrl_cpu``.

``paged.cpp`` reads and compacts vLLM's CPU paged cache; ``scores.cpp`` computes the
attention the observation queries pay each slot (H2O, SnapKV, R-KV, G-KV) and R-KV's and
G-KV's key redundancy one head at a time. :mod:`kvrl.kernels.cpu.paged` and
:mod:`kvrl.kernels.cpu.scores` wrap them with the signatures of their torch specification
(:mod:`kvrl.kernels.reference`), which the tests compare them with and which runs where
they cannot be built (:mod:`kvrl.kernels.dispatch` asks :func:`usable`).

The build uses torch's C++ extension loader (a C++ compiler and ninja; about 20 s once, cached
in ``~/.cache/torch_extensions``, rebuilt when a source changes). Every checkout shares that
folder; builds are serialised by an ``flock``, which the kernel releases when its holder dies,
so a process killed mid-build (a Ctrl-C on a first run) cannot leave the others waiting on
torch's own lock file forever: it is removed, with a warning, by the next process to build.
"""

from __future__ import annotations

import fcntl
import functools
import warnings
from pathlib import Path

import torch

SOURCES = ("paged.cpp", "scores.cpp")
# Vector instructions by the capability torch detects at run time; each capability builds
# its own library (the name carries it), so a cache folder shared by different CPUs holds
# one per kind instead of code that faults on the other.
FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]}


@functools.cache
def ops():
    """``torch.ops.kvrl_cpu`` once built, else None (with one warning naming the fix)."""
    try:
        from torch.utils.cpp_extension import load

        here = Path(__file__).parent
        capability = torch.backends.cpu.get_cpu_capability()  # what torch's own kernels use here
        name = f"kvrl_cpu_{capability.lower()}"
        build = build_dir(name)
        with open(build / "kvrl.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
            baton = build / "lock"  # torch's: under our lock, no live kvrl process holds it
            if baton.exists():
                warnings.warn(
                    f"removed a stale build lock {baton}, left by a process killed while building kvrl's native ops",
                    stacklevel=2,
                )
                baton.unlink()
            # -fno-trapping-math lets GCC if-convert the masked max and exp loops of scores.cpp
            # into vector code (nothing here reads floating-point exception flags).
            load(
                name=name,
                sources=[str(here / s) for s in SOURCES],
                build_directory=str(build),
                extra_cflags=["-O3", "-fno-trapping-math", *FLAGS.get(capability, [])],
                is_python_module=False,
                verbose=False,
            )
        return torch.ops.kvrl_cpu
    except Exception as exc:  # no compiler, no ninja, an unwritable cache folder
        warnings.warn(
            f"kvrl's native CPU ops did not build ({type(exc).__name__}: {exc}); reading and compacting "
            "the vLLM cache and the policies' scores fall back to torch ops, 2-4x slower. Install g++ and "
            "ninja (pip install ninja) to build them.",
            stacklevel=2,
        )
        return None


def build_dir(name: str) -> Path:
    """Where torch's loader builds ``name`` (``TORCH_EXTENSIONS_DIR`` or its default), created."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the native ops apply: CPU tensors outside autograd, and the ops built."""
    return all(t.device.type == "cpu" and not t.requires_grad for t in tensors) and ops() is not None
