"""The native CPU cache ops (kvrl/kernels/cpu/paged.py) against their torch specification
(kvrl/kernels/reference/paged.py).

Both move data only, so the native results must equal the references exactly."""

import pytest
import torch

from kvrl import kernels
from kvrl.kernels.cpu import native
from kvrl.kernels.reference import paged as reference

if native.ops() is None:
    pytest.skip("the native CPU cache ops did not build here (see the warning)", allow_module_level=True)


def cache(dtype, nb=40, h=3, bs=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nb, h, bs, 2 * d, generator=g).to(dtype)


def tables(rows, width, nb, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(nb - 1, generator=g)[: rows * width].view(rows, width).int() + 1  # block 0: vLLM's null


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4, 13, 24])
def test_read_matches_reference(dtype, n):
    kv, blocks = cache(dtype), tables(5, 6, 40)
    k, v = kernels.paged_read(kv, blocks, n)
    k_ref, v_ref = reference.paged_read(kv, blocks, n)
    assert k.shape == k_ref.shape == (5, 3, n, 8) and v.shape == v_ref.shape
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    for read in (kernels.paged_read, reference.paged_read):  # keys alone: the same keys, no V
        k_only, none = read(kv, blocks, n, values=False)
        assert none is None and torch.equal(k_only, k_ref)


def ascending_keep(rows, h, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(rows * h)]).view(rows, h, k)
    keep[0, 0] = torch.arange(k)  # a head that keeps its prefix: nothing moves
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [False, True])
def test_compact_matches_reference(dtype, ratio):
    rows, h, n, k, bs = 5, 3, 23, 14, 4
    kv, blocks = cache(dtype), tables(rows, 6, 40, seed=1)
    keep = ascending_keep(rows, h, n, k, seed=2)
    counts = torch.tensor([14, 9, 4, 13, 1]) if ratio else None
    if ratio:  # past its count a row's keep is ignored: fill it with slots that must not be read
        keep = torch.where(torch.arange(k) < counts[:, None, None], keep, n - 1)
    before = kv.clone()
    got, want = kv.clone(), kv.clone()
    kernels.paged_compact_(got, blocks, keep, counts)
    reference.paged_compact_(want, blocks, keep, counts)
    lens = counts if ratio else torch.full((rows,), k)
    k_got, v_got = reference.paged_read(got, blocks, k)
    k_want, v_want = reference.paged_read(want, blocks, k)
    k_src, v_src = reference.paged_read(before, blocks, n)
    for r in range(rows):
        c = int(lens[r])
        assert torch.equal(k_got[r, :, :c], k_want[r, :, :c]) and torch.equal(v_got[r, :, :c], v_want[r, :, :c])
        idx = keep[r, :, :c]  # and both hold what the kept slots held before
        assert torch.equal(k_got[r, :, :c], k_src[r].gather(1, idx[..., None].expand(-1, -1, 8)))
        assert torch.equal(v_got[r, :, :c], v_src[r].gather(1, idx[..., None].expand(-1, -1, 8)))
    # blocks past each row's count, and blocks in no table, are untouched
    written = torch.zeros(kv.shape[0], dtype=torch.bool)
    for r in range(rows):
        written[blocks[r, : -(-int(lens[r]) // bs)].long()] = True
    assert torch.equal(got[~written], before[~written])


def test_compact_rejects_a_bad_keep():
    kv, blocks = cache(torch.float32), tables(2, 6, 40)
    with pytest.raises(RuntimeError, match=r"keep must be contiguous int64 \[R, H, K\]"):
        native.ops().paged_compact_(kv, blocks.long(), torch.zeros(2, 2, 3, dtype=torch.long), None)


def test_a_failed_build_warns_with_the_fix_and_the_references_run(monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no library built for these sources there

    def no_compiler(*a, **k):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr(native, "ops", native.ops.__wrapped__)
    with pytest.warns(UserWarning, match=r"fall back to torch ops.*Install g\+\+ and ninja"):
        assert native.ops() is None
    kv, blocks = cache(torch.float32), tables(2, 6, 40)
    with pytest.warns(UserWarning):
        k, v = kernels.paged_read(kv, blocks, 9)
    assert torch.equal(k, reference.paged_read(kv, blocks, 9)[0])


def test_compact_refuses_what_would_write_outside_the_request():
    kv, blocks = cache(torch.float32), tables(1, 6, 40)
    before = kv.clone()
    descending = torch.arange(8).flip(0).view(1, 1, 8).expand(1, 3, 8).contiguous()
    with pytest.raises(RuntimeError, match="keep must hold ascending slots of the block table"):
        kernels.paged_compact_(kv, blocks, descending, None)
    beyond = (torch.arange(8) + 17).view(1, 1, 8).expand(1, 3, 8).contiguous()  # slot 24: past the 6-block table
    with pytest.raises(RuntimeError, match="keep must hold ascending slots of the block table"):
        kernels.paged_compact_(kv, blocks, beyond, None)
    with pytest.raises(RuntimeError, match="is outside the cache's 40 blocks"):
        kernels.paged_read(kv, blocks + 100, 8)
    identity = torch.arange(8).view(1, 1, 8).expand(1, 3, 8).contiguous()
    with pytest.raises(RuntimeError, match="is outside the cache's 40 blocks"):
        kernels.paged_compact_(kv, blocks + 100, identity, None)
    assert torch.equal(kv[blocks[0, 1:].long()], before[blocks[0, 1:].long()])
