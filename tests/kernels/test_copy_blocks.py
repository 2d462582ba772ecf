import random

import pytest
import torch
from kernels_testlib import DEVICE, DTYPES, dname, needs_triton

from kernels.copy_blocks import copy_blocks_torch, copy_blocks_triton


def _case(dtype, bs=16, hkv=2, d=64, num_layers=3, num_blocks=12, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn((num_layers, 2, num_blocks, bs, hkv, d), generator=gen).to(dtype)
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    src, dst = ids[:n], ids[n : 2 * n]  # dst never aliases a src
    # a block may be the source of several copies (n>1 samples forking one partial block)
    src[-1] = src[0]
    mapping = torch.tensor(list(zip(src, dst)), dtype=torch.int64)
    return kv_cache.to(DEVICE), mapping.to(DEVICE)


def _naive(kv_cache, mapping):
    out = kv_cache.clone().cpu()
    for src, dst in mapping.tolist():
        out[:, :, dst] = kv_cache.cpu()[:, :, src]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("bs,hkv,d", [(8, 1, 64), (16, 3, 128), (32, 8, 64), (16, 2, 80)])
def test_reference_matches_naive(dtype, bs, hkv, d):
    kv_cache, mapping = _case(dtype, bs, hkv, d)
    expected = _naive(kv_cache, mapping)
    copy_blocks_torch(kv_cache, mapping)
    torch.testing.assert_close(kv_cache.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_many_rows(backend):
    """More rows than the reference's per-row loop handles (it switches to index_copy_)."""
    kv_cache, mapping = _case(torch.float32, bs=4, hkv=1, d=16, num_layers=2, num_blocks=200, n=90, seed=4)
    expected = _naive(kv_cache, mapping)
    (copy_blocks_torch if backend == "torch" else copy_blocks_triton)(kv_cache, mapping)
    torch.testing.assert_close(kv_cache.cpu(), expected, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("bs,hkv,d", [(8, 1, 64), (16, 3, 128), (32, 8, 64), (16, 2, 80)])
def test_triton_matches_reference(dtype, bs, hkv, d):
    kv_cache, mapping = _case(dtype, bs, hkv, d, seed=1)
    ref = kv_cache.clone()
    copy_blocks_torch(ref, mapping)
    copy_blocks_triton(kv_cache, mapping)
    torch.testing.assert_close(kv_cache, ref, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_int32_strided_mapping_and_noop(backend):
    fn = copy_blocks_torch if backend == "torch" else copy_blocks_triton
    kv_cache, mapping = _case(torch.float32, seed=2)
    expected = _naive(kv_cache, mapping)
    fn(kv_cache, mapping.to(torch.int32).t().contiguous().t())  # int32, column-major
    torch.testing.assert_close(kv_cache.cpu(), expected, rtol=0, atol=0)
    before = kv_cache.clone()
    fn(kv_cache, torch.zeros((0, 2), dtype=torch.int64, device=DEVICE))
    assert torch.equal(kv_cache, before)


_BAD = {
    "ndim": lambda kv, m: (kv[0], m),
    "not_kv_pair": lambda kv, m: (kv[:, :1], m),
    "int_cache": lambda kv, m: (kv.long(), m),
    "block_not_contiguous": lambda kv, m: (kv.transpose(3, 4), m),
    "mapping_cols": lambda kv, m: (kv, m[:, :1]),
    "mapping_1d": lambda kv, m: (kv, m[:, 0]),
    "mapping_float": lambda kv, m: (kv, m.float()),
}


@pytest.mark.parametrize("bad", list(_BAD))
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_validation(bad, backend):
    kv_cache, mapping = _case(torch.float32, num_layers=1)
    fn = copy_blocks_torch if backend == "torch" else copy_blocks_triton
    with pytest.raises(ValueError, match="copy_blocks"):
        fn(*_BAD[bad](kv_cache, mapping))


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kv_cache, mapping = _case(torch.float32, num_layers=1)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        copy_blocks_triton(kv_cache, mapping)
