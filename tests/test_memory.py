"""Peak memory grows linearly with sequence length (and stays far below the dense versions)
for the two places that blew up at the papers' sizes: the LM head's logprobs
(:func:`kvrl.kernels.reference.logprobs.token_logprobs`, forward + backward, vs dense
``log_softmax(hidden @ weight.T)``) and Golden Eviction's score preparation
(:func:`kvrl.policies.golden.record_attention` + one eviction step's scores, vs the dense
``output_attentions`` implementation it replaced, copied in ``tests/test_golden.py``).

How memory is measured, and why: on CPU torch has no allocator statistics (the
``torch.cuda.max_memory_allocated`` of CUDA), ``tracemalloc`` does not see torch's
allocations, and the profiler's ``profile_memory`` reports per-op allocations, not a peak.
What is reliable is the kernel's resident-set high-water mark, measured in a fresh
subprocess (so nothing else the test session allocated is counted):

* glibc is told (``mallopt``) to serve every allocation above 64 KiB with its own ``mmap``
  and to trim freed memory at once, so a freed tensor leaves the resident set at once and a
  new one has to fault its pages in (otherwise glibc's dynamic mmap threshold would recycle
  freed blocks from its heap and hide part of the next peak);
* before each measurement ``/proc/self/clear_refs`` is written ``5``, which resets the
  process's ``VmHWM`` (peak RSS) to its current RSS; the peak of a measurement is
  ``VmHWM`` after it minus ``VmRSS`` before it (Linux ≥ 4.0 only: skipped elsewhere);
* each measured function runs once at a small size first, so lazily loaded code and
  one-off buffers are not counted.

Run it by hand for the numbers: ``python tests/test_memory.py [logprobs|golden] [--full]``
prints them as JSON (``--full``: the dense versions at every size too).
"""

import ctypes
import gc
import json
import os
import subprocess
import sys
import time

import pytest

MiB = 2**20
LOGPROB_SIZES = (2048, 4096, 8192)  # tokens N, vocab 32K
GOLDEN_SIZES = (2048, 4096, 8192)  # trace length T


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak(fn) -> float:
    """Peak resident memory (MiB) that fn() adds above what the process holds before it."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    fn()
    return (_status("VmHWM") - base) / MiB


def logprob_peaks(full: bool) -> dict:
    import torch

    from kvrl.kernels.reference.logprobs import token_logprobs

    V, D = 32768, 32

    def run(N, dense):
        g = torch.Generator().manual_seed(N)
        h = (torch.randn(N, D, generator=g) * 0.3).requires_grad_()
        w = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
        t = torch.randint(V, (N,), generator=g)

        def step():
            if dense:
                logp = torch.log_softmax(h @ w.T, -1)
                lp, ent = logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
            else:
                lp, ent = token_logprobs(h, w, t, chunk=1024)
            (lp.sum() + 0.1 * ent.sum()).backward()

        return peak(step)

    run(256, False), run(256, True)  # warm-up
    return {
        "new": {N: run(N, False) for N in LOGPROB_SIZES},
        "dense": {N: run(N, True) for N in (LOGPROB_SIZES if full else LOGPROB_SIZES[:1])},
    }


def golden_peaks(full: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.dirname(__file__))
    from test_golden import block_attention  # the dense reference

    from kvrl.policies.golden import GoldenEviction, record_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max(GOLDEN_SIZES),
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    interval, budget = 128, 512

    def run(T, dense):
        ids = torch.randint(97, (T,), generator=torch.Generator().manual_seed(T))
        e = T // 2  # an eviction step half-way: budget + interval cached keys before it
        pos = torch.arange(e - budget - interval, e).expand(1, 2, -1)

        def step():
            kv = dict(budget=budget, interval=interval, window=8)
            obs = type("Obs", (), dict(key_pos=pos, query_pos=torch.tensor([[e - 1]]), layer=1, keys=torch.empty(0)))
            if dense:
                from test_golden import DenseGolden

                blocks, starts = block_attention(model, ids, 64, interval)
                DenseGolden(**kv, blocks=blocks, starts=starts).score(obs)
            else:
                GoldenEviction(**kv, attention=record_attention(model, ids, 64, interval)).score(obs)

        return peak(step)

    run(1024, False), run(1024, True)  # warm-up
    return {
        "new": {T: run(T, False) for T in GOLDEN_SIZES},
        "dense": {T: run(T, True) for T in (GOLDEN_SIZES if full else GOLDEN_SIZES[:2])},
    }


def measure(what: str, full: bool = False) -> dict:
    """The peaks (MiB) of ``what`` (logprobs | golden), in this process (call it in a fresh
    one). The dense versions are measured at the smaller sizes only unless ``full`` (they
    take most of the time; their peak only grows with the size, so the new ones' largest
    peak below the dense ones' smaller is below the dense ones' largest a fortiori)."""
    import torch

    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: big blocks are mmapped (and unmapped when freed)
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    start = time.perf_counter()
    out = {"logprobs": logprob_peaks, "golden": golden_peaks}[what](full)
    return {**out, "seconds": round(time.perf_counter() - start, 1)}


@pytest.fixture(scope="module")
def peaks() -> dict:
    """measure() of both, each in a fresh single-threaded process, the two side by side
    (one core each). glibc backs its mmapped blocks with huge pages there (fewer page
    faults: about twice as fast, same peaks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    procs = {
        what: subprocess.Popen(
            [sys.executable, __file__, what], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for what in ("logprobs", "golden")
    }
    out = {}
    for what, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        m = json.loads(stdout.strip().splitlines()[-1])
        out[what] = {k: ({int(n): p for n, p in v.items()} if isinstance(v, dict) else v) for k, v in m.items()}
    return out


needs_linux = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")),
    reason="peak RSS is measured with /proc/self/clear_refs (Linux)",
)


@needs_linux
def test_logprobs_memory_is_linear_and_far_below_dense(peaks):
    """Forward + backward at vocab 32K: the chunked head holds O(chunk·V + N·D), flat in N
    here; the dense one holds several [N, V] float32 tensors (256 MiB each at N = 2K)."""
    m = peaks["logprobs"]
    new, dense = m["new"], m["dense"]
    sizes = sorted(new)
    for a, b in zip(sizes, sizes[1:]):
        assert new[b] / new[a] < 2.5, m
    assert new[sizes[-1]] < dense[sizes[0]] / 3, m  # dense at N=2K already; 4x that at 8K
    assert dense[sizes[0]] > 3 * sizes[0] * 32768 * 4 / MiB, m  # the measurement sees ≥ 3 [N, V] float32


@needs_linux
def test_golden_memory_is_linear_and_far_below_dense(peaks):
    """Golden Eviction's preparation (record_attention) and one eviction step's scores on a
    tiny random Llama: O(T) per layer, against the dense T×T attention maps (~4× per 2× T)."""
    m = peaks["golden"]
    new, dense = m["new"], m["dense"]
    sizes = sorted(new)
    for a, b in zip(sizes, sizes[1:]):
        assert new[b] / new[a] < 2.5, m
    d = sorted(dense)
    assert dense[d[1]] / dense[d[0]] > 3, m  # the reference really is quadratic: the measurement sees it
    assert new[sizes[-1]] < dense[d[1]] / 5, m  # dense at T=4K already; ~4x that at 8K


if __name__ == "__main__":
    which = [w for w in ("logprobs", "golden") if w in sys.argv] or ["logprobs", "golden"]
    print(
        json.dumps(
            {w: measure(w, full="--full" in sys.argv) for w in which}
            if len(which) > 1
            else measure(which[0], full="--full" in sys.argv)
        )
    )
