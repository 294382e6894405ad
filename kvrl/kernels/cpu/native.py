"""kvrl's native CPU ops, built on first use: ``torch.ops.kvrl_cpu``.

``paged.cpp`` reads and compacts vLLM's CPU paged cache; ``scores.cpp`` computes the
attention the observation queries pay each slot (H2O, SnapKV, R-KV, G-KV) and R-KV's and
G-KV's key redundancy one head at a time. :mod:`kvrl.kernels.cpu.paged` and
:mod:`kvrl.kernels.cpu.scores` wrap them with the signatures of their torch specification
(:mod:`kvrl.kernels.reference`), which the tests compare them with and which runs where
they cannot be built (:mod:`kvrl.kernels.dispatch` asks :func:`usable`).

The build uses torch's C++ extension loader (a C++ compiler and ninja; about 20 s once on an
idle machine, minutes on a few busy cores), in ``~/.cache/torch_extensions`` (or
``TORCH_EXTENSIONS_DIR``). The library's name carries a hash of what went into it (the
sources' text, the compiler's version, torch's version, the flags; :func:`extension_name`),
and a library already built under that name is loaded as it is: every checkout with the same
sources shares one build, and a change to any of them builds another, never over the first.
A build prints one line on stderr when it starts. Every checkout shares that folder; builds
are serialised by an ``flock``, which the kernel releases when its holder dies, so a process
killed mid-build (a Ctrl-C on a first run) cannot leave the others waiting on torch's own
lock file forever: it is removed, with a warning, by the next process to build.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import subprocess
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = ("paged.cpp", "scores.cpp")
# -fno-trapping-math lets GCC if-convert the masked max and exp loops of scores.cpp into vector code
# (nothing here reads floating-point exception flags).
CFLAGS = ["-O3", "-fno-trapping-math"]
# Vector instructions by the capability torch detects at run time; each capability builds
# its own library (the name carries it), so a cache folder shared by different CPUs holds
# one per kind instead of code that faults on the other.
FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]}


@functools.cache
def ops():
    """``torch.ops.kvrl_cpu`` once built, else None (with one warning naming the fix)."""
    try:
        from torch.utils.cpp_extension import load

        name, flags = extension_name(), cflags()
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
            library = build / f"{name}.so"
            if library.exists():  # the name says what it was built from; torch's loader would rerun ninja,
                # which rebuilds whenever the sources' paths or times differ (another checkout, a fresh clone)
                try:
                    torch.ops.load_library(str(library))
                    return torch.ops.kvrl_cpu
                except OSError:  # a link killed half-way left it unreadable: built again below
                    library.unlink()
            print(
                f"kvrl: building the native CPU ops ({name}) in {build}: about 20 s on an idle machine, minutes on "
                "a few busy cores; once for these sources, compiler and torch",
                file=sys.stderr,
                flush=True,
            )
            load(
                name=name,
                sources=[str(HERE / s) for s in SOURCES],
                build_directory=str(build),
                extra_cflags=flags,
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


def cflags() -> list[str]:
    """The compiler flags for this machine's vector capability."""
    return [*CFLAGS, *FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]


@functools.cache
def extension_name() -> str:
    """The library's name here: ``kvrl_cpu_<capability>_<key>``, the key :func:`build_key` of this
    checkout's sources, the compiler torch's loader runs (``CXX``, else ``c++``) and the flags."""
    from torch.utils.cpp_extension import get_cxx_compiler

    compiler = get_cxx_compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    sources = {s: (HERE / s).read_text() for s in SOURCES}
    capability = torch.backends.cpu.get_cpu_capability()  # what torch's own kernels use here
    return f"kvrl_cpu_{capability.lower()}_{build_key(sources, f'{compiler}: {version}', cflags())}"


def build_key(sources: dict[str, str], compiler: str, flags: list[str]) -> str:
    """12 hex digits of a hash of what a build is made of: each source's name and text, the
    compiler (its command and its ``--version``), torch's version (the headers and the ABI) and
    the flags. Equal for equal inputs, in any checkout."""
    digest = hashlib.sha256()
    for part in (*(x for item in sorted(sources.items()) for x in item), compiler, torch.__version__, *flags):
        digest.update(part.encode() + b"\0")  # separated: ("ab", "c") and ("a", "bc") differ
    return digest.hexdigest()[:12]


def build_dir(name: str) -> Path:
    """Where torch's loader builds ``name`` (``TORCH_EXTENSIONS_DIR`` or its default), created."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the native ops apply: CPU tensors outside autograd, and the ops built."""
    return all(t.device.type == "cpu" and not t.requires_grad for t in tensors) and ops() is not None
