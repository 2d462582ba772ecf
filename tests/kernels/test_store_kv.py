import random

import pytest
import torch
from kernels_testlib import DEVICE, config_grid, needs_triton

from kernels.store_kv import store_kv_torch, store_kv_triton
from kernels.cpu.store_kv import store_kv_cpu

# The C kernel on CPU (with no C compiler it is the reference, and these still pass).
_CPU = pytest.param("cpu", marks=pytest.mark.skipif(DEVICE.type != "cpu", reason="a CPU kernel"))
_FN = {"torch": store_kv_torch, "triton": store_kv_triton, "cpu": store_kv_cpu}


def _case(hkv, d, bs, dtype, num_tokens=23, seed=0, num_layers=2):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 7
    kv_cache = torch.full((num_layers, 2, num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    slots = random.Random(seed).sample(range(num_blocks * bs), num_tokens)
    for i in (3, 11, num_tokens - 1):  # padding tokens
        slots[i] = -1
    key = torch.randn((num_tokens, hkv, d), generator=gen).to(dtype)
    value = torch.randn((num_tokens, hkv, d), generator=gen).to(dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    return key.to(DEVICE), value.to(DEVICE), kv_cache.to(DEVICE), slot_mapping.to(DEVICE)


def _naive(key, value, kv_cache, slot_mapping, layer):
    out = kv_cache.clone().cpu()
    bs = kv_cache.shape[3]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        out[layer, 0, slot // bs, slot % bs] = key[t].cpu()
        out[layer, 1, slot // bs, slot % bs] = value[t].cpu()
    return out


@pytest.mark.parametrize("g,d,bs,dtype", config_grid())
def test_reference_matches_naive(g, d, bs, dtype):
    hkv = g  # store_kv only sees KV heads: use 1, 3, 8 of them
    key, value, kv_cache, slot_mapping = _case(hkv, d, bs, dtype)
    expected = _naive(key, value, kv_cache, slot_mapping, layer=1)
    store_kv_torch(key, value, kv_cache[1, 0], kv_cache[1, 1], slot_mapping)
    # exact copy; untouched slots (incl. all of layer 0) stay NaN
    torch.testing.assert_close(kv_cache.cpu(), expected, rtol=0, atol=0, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("g,d,bs,dtype", config_grid())
def test_triton_matches_reference(g, d, bs, dtype):
    hkv = g
    key, value, kv_cache, slot_mapping = _case(hkv, d, bs, dtype, seed=1)
    ref_cache = kv_cache.clone()
    store_kv_torch(key, value, ref_cache[1, 0], ref_cache[1, 1], slot_mapping)
    store_kv_triton(key, value, kv_cache[1, 0], kv_cache[1, 1], slot_mapping)
    torch.testing.assert_close(kv_cache, ref_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("g,d,bs,dtype", config_grid())
def test_cpu_kernel_matches_reference(g, d, bs, dtype):
    if DEVICE.type != "cpu":
        pytest.skip("a CPU kernel")
    key, value, kv_cache, slot_mapping = _case(g, d, bs, dtype, seed=2)
    ref_cache = kv_cache.clone()
    store_kv_torch(key, value, ref_cache[1, 0], ref_cache[1, 1], slot_mapping)
    store_kv_cpu(key, value, kv_cache[1, 0], kv_cache[1, 1], slot_mapping)
    torch.testing.assert_close(kv_cache, ref_cache, rtol=0, atol=0, equal_nan=True)


def test_cpu_kernel_refuses_a_slot_past_the_pool_writing_nothing():
    kv = torch.zeros((1, 2, 2, 4, 1, 8))
    with pytest.raises(IndexError, match="store_kv"):
        store_kv_cpu(torch.ones((2, 1, 8)), torch.ones((2, 1, 8)), kv[0, 0], kv[0, 1], torch.tensor([1, 8]))
    assert kv.abs().sum().item() == 0
    kv_strided = torch.zeros((2, 4, 8, 1)).transpose(2, 3)  # [NB, BS, 1, 8] with rows not packed: reference
    store_kv_cpu(torch.ones((1, 1, 8)), torch.ones((1, 1, 8)), kv_strided, kv_strided.clone(), torch.tensor([5]))
    assert kv_strided[1, 1].sum().item() == 8


@pytest.mark.parametrize("backend", ["torch", _CPU, pytest.param("triton", marks=needs_triton)])
def test_strided_inputs_and_int32_slots(backend):
    # key/value as head slices of a fused qkv projection: rows are strided, last dim contiguous
    hq, hkv, d, bs = 4, 2, 16, 8
    qkv = torch.randn((9, hq + 2 * hkv, d), device=DEVICE)
    key, value = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    kv_cache = torch.full((1, 2, 4, bs, hkv, d), float("nan"), device=DEVICE)
    slots = torch.tensor([5, 0, 31, -1, 8, 9, 17, 3, 30], dtype=torch.int32, device=DEVICE)
    fn = _FN[backend]
    fn(key, value, kv_cache[0, 0], kv_cache[0, 1], slots)
    expected = _naive(key, value, torch.full_like(kv_cache, float("nan")), slots, layer=0)
    torch.testing.assert_close(kv_cache.cpu(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["torch", _CPU, pytest.param("triton", marks=needs_triton)])
def test_empty_and_all_padding(backend):
    fn = _FN[backend]
    kv = torch.zeros((1, 2, 2, 4, 1, 8), device=DEVICE)
    fn(torch.ones((0, 1, 8), device=DEVICE), torch.ones((0, 1, 8), device=DEVICE), kv[0, 0], kv[0, 1],
       torch.zeros((0,), dtype=torch.int64, device=DEVICE))
    fn(torch.ones((3, 1, 8), device=DEVICE), torch.ones((3, 1, 8), device=DEVICE), kv[0, 0], kv[0, 1],
       torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert kv.abs().sum().item() == 0


def _valid_args():
    kv = torch.zeros((1, 2, 4, 8, 2, 16), device=DEVICE)
    key = torch.randn((3, 2, 16), device=DEVICE)
    return dict(key=key, value=key.clone(), k_cache=kv[0, 0], v_cache=kv[0, 1],
                slot_mapping=torch.tensor([0, 1, 2], device=DEVICE))


_BAD = {
    "key_ndim": lambda a: a.update(key=a["key"][0]),
    "key_heads": lambda a: a.update(key=torch.randn((3, 3, 16), device=DEVICE)),
    "key_dtype": lambda a: a.update(key=a["key"].half()),
    "value_shape": lambda a: a.update(value=torch.randn((2, 2, 16), device=DEVICE)),
    "key_last_dim_strided": lambda a: a.update(key=torch.randn((3, 2, 32), device=DEVICE)[..., ::2]),
    "cache_dtype_mismatch": lambda a: a.update(v_cache=a["v_cache"].half()),
    "cache_ndim": lambda a: a.update(k_cache=a["k_cache"][0]),
    "cache_int": lambda a: a.update(k_cache=a["k_cache"].long(), v_cache=a["v_cache"].long()),
    "slots_len": lambda a: a.update(slot_mapping=torch.tensor([0, 1], device=DEVICE)),
    "slots_dtype": lambda a: a.update(slot_mapping=torch.tensor([0.0, 1.0, 2.0], device=DEVICE)),
    "slots_2d": lambda a: a.update(slot_mapping=torch.tensor([[0, 1, 2]], device=DEVICE)),
}


@pytest.mark.parametrize("bad", list(_BAD))
@pytest.mark.parametrize("backend", ["torch", _CPU, pytest.param("triton", marks=needs_triton)])
def test_validation(bad, backend):
    args = _valid_args()
    _BAD[bad](args)
    fn = _FN[backend]
    with pytest.raises(ValueError, match="store_kv"):
        fn(**args)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        store_kv_triton(**_valid_args())
