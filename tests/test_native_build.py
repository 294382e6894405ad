"""The native CPU ops' build (kvrl/kernels/cpu/native.py): the name its cache is keyed by, and the
line a build prints. No test here compiles: a build that starts is run with a compiler that fails."""

import os
import shutil
import subprocess
import sys

from kvrl.kernels.cpu import native

SOURCES = {"paged.cpp": "int f() { return 1; }\n", "scores.cpp": "int g() { return 2; }\n"}
FLAGS = ["-O3", "-mavx2"]


def test_the_build_key_changes_with_what_is_built_and_only_with_it():
    key = native.build_key(SOURCES, "c++: gcc 12.2.0", FLAGS)
    assert native.build_key(dict(reversed(SOURCES.items())), "c++: gcc 12.2.0", list(FLAGS)) == key
    edited = {**SOURCES, "scores.cpp": SOURCES["scores.cpp"].replace("2", "3")}
    assert native.build_key(edited, "c++: gcc 12.2.0", FLAGS) != key
    assert native.build_key(SOURCES, "c++: gcc 13.1.0", FLAGS) != key
    assert native.build_key(SOURCES, "c++: gcc 12.2.0", ["-O3"]) != key
    assert len(key) == 12 and int(key, 16) >= 0


def fake_compiler(folder, version: str):
    """A CXX that says ``version`` to --version and fails anything else (a compile fails at once)."""
    path = folder / "g++"
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "{version}" && exit 0\nexit 1\n')
    path.chmod(0o755)
    return str(path)


def test_the_extension_name_is_the_checkout_independent_key_of_the_sources_and_compiler(tmp_path, monkeypatch):
    """Two checkouts of the same sources share one build (alternating between them rebuilt it each time,
    under one name); an edited source or another compiler gets its own."""
    here = native.extension_name.__wrapped__()
    other = tmp_path / "other_checkout"
    other.mkdir()
    for s in native.SOURCES:
        shutil.copy(native.HERE / s, other / s)
    monkeypatch.setattr(native, "HERE", other)
    assert native.extension_name.__wrapped__() == here
    (other / "scores.cpp").write_text((other / "scores.cpp").read_text() + "\n// edited\n")
    edited = native.extension_name.__wrapped__()
    assert edited != here and edited.startswith("kvrl_cpu_")
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, "g++ (Other) 99.0"))
    assert native.extension_name.__wrapped__() not in (here, edited)


def test_a_build_says_so_on_stderr_when_it_starts(tmp_path):
    """A first build took minutes with nothing printed. Now the line comes before the compile (which
    here fails at once: the fallback warning follows it)."""
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
        "CXX": fake_compiler(tmp_path, "g++ (Fake) 0.0"),
    }
    code = "from kvrl.kernels.cpu import native; assert native.ops() is None"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if "building the native CPU ops" in line]
    assert len(lines) == 1 and "kvrl_cpu_" in lines[0] and str(tmp_path / "ext") in lines[0], res.stderr[-2000:]
    assert res.stderr.index(lines[0]) < res.stderr.index("did not build")
