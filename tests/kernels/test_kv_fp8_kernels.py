"""The fp8 KV cache (kernels/kv_quant.py) in every KV op: store_kv, decode and prefill attention, copy_blocks.

Each backend's kernel against its torch reference on the same fp8 pool (the Triton kernels under the
interpreter on CPU; the C kernels as built here and for AVX2 only), the references against their definition
(model-dtype attention over the dequantized pool), store_kv's rounding against torch's conversion bit for bit,
and fp8 attention against model-dtype attention on the same values within e4m3's precision.
"""
import pytest
import torch
from kernels_testlib import DEVICE, TOL, PagedKV, avx2_kernels, dname, needs_triton

from kernels.copy_blocks import copy_blocks_torch, copy_blocks_triton
from kernels.cpu import native as _native
from kernels.cpu.fp8_kv import _decode, fp8_cpu_ops
from kernels.cpu.paged_attention import paged_attention_decode_cpu, paged_attention_prefill_cpu
from kernels.cpu.store_kv import store_kv_cpu
from kernels.kv_quant import FP8_E4M3, FP8_MAX, dequantize, kv_cache_ops, kv_cache_torch_dtype, quantize
from kernels.ops import reference_ops
from kernels.paged_attention_decode import paged_attention_decode_torch, paged_attention_decode_triton
from kernels.paged_attention_prefill import paged_attention_prefill_torch, paged_attention_prefill_triton
from kernels.store_kv import store_kv_torch, store_kv_triton

CPU_ONLY = pytest.mark.skipif(DEVICE.type != "cpu", reason="a CPU kernel")
STORES = {"torch": store_kv_torch,
          "triton": pytest.param(store_kv_triton, marks=needs_triton),
          "cpu": pytest.param(store_kv_cpu, marks=CPU_ONLY)}
DECODES = {"triton": pytest.param(paged_attention_decode_triton, marks=needs_triton),
           "cpu": pytest.param(paged_attention_decode_cpu, marks=CPU_ONLY)}
PREFILLS = {"triton": pytest.param(paged_attention_prefill_triton, marks=needs_triton),
            "cpu": pytest.param(paged_attention_prefill_cpu, marks=CPU_ONLY)}
# Scales: 1.0 (vLLM's default without calibration, ours always) and powers of two, which divide exactly on
# every device (torch on CUDA multiplies by a scalar's reciprocal instead of dividing).
SCALES = [(1.0, 1.0), (0.5, 4.0)]
HKV = 2


def _fp8_pool(kv: PagedKV) -> torch.Tensor:
    """PagedKV's values quantized (its NaN poison becomes e4m3's NaN byte, 0x7f)."""
    return quantize(kv.kv_cache, 1.0)


def _bytes(t):
    return t.view(torch.uint8).cpu()


# --------------------------------------------------------------------------- store_kv
def _store_case(hkv, d, bs, dtype, num_tokens=23, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.full((2, 2, 7, bs, hkv, d), float("nan")).to(FP8_E4M3)  # poison: 0x7f everywhere
    slots = torch.randperm(7 * bs, generator=gen)[:num_tokens]
    slots[[3, 11, num_tokens - 1]] = -1  # padding tokens
    # magnitudes from 1e-4 (subnormal in e4m3) to 1e3 (clamped at 448)
    key = (torch.randn((num_tokens, hkv, d), generator=gen) * torch.logspace(-4, 3, d)).to(dtype)
    value = (torch.randn((num_tokens, hkv, d), generator=gen) * torch.logspace(-4, 3, d)).to(dtype)
    return key.to(DEVICE), value.to(DEVICE), cache.to(DEVICE), slots.to(DEVICE)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dname)
def test_store_kv_reference_is_its_definition(dtype, k_scale, v_scale):
    key, value, cache, slots = _store_case(3, 64, 16, dtype)
    expected = cache.clone().cpu()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:  # e4m3(clamp(x / scale, -448, 448)), rounded as torch converts
            expected[1, 0, s // 16, s % 16] = (key[t].float().cpu() / k_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3)
            expected[1, 1, s // 16, s % 16] = (value[t].float().cpu() / v_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3)
    store_kv_torch(key, value, cache[1, 0], cache[1, 1], slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(_bytes(cache), _bytes(expected))  # untouched slots (all of layer 0) keep their poison


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("g,d,bs,dtype", [(1, 64, 16, torch.float32), (3, 128, 8, torch.bfloat16),
                                          (8, 64, 32, torch.float16), (2, 80, 16, torch.float32)],
                         ids=lambda v: dname(v) if isinstance(v, torch.dtype) else str(v))
@pytest.mark.parametrize("store", list(STORES.values()), ids=list(STORES))
def test_store_kv_matches_the_reference_bit_for_bit(store, g, d, bs, dtype, k_scale, v_scale):
    key, value, cache, slots = _store_case(g, d, bs, dtype, seed=g + d)
    ref = cache.clone()
    store_kv_torch(key, value, ref[1, 0], ref[1, 1], slots, k_scale=k_scale, v_scale=v_scale)
    store(key, value, cache[1, 0], cache[1, 1], slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(_bytes(cache), _bytes(ref))


@pytest.mark.parametrize("store", list(STORES.values()), ids=list(STORES))
def test_e4m3_rounding_is_torchs_on_every_tie_and_edge(store):
    """The Triton and C kernels round in integer arithmetic (the interpreter's float8 cast differs): every e4m3
    value, every midpoint between neighbours (ties go to even), values just off them, the clamp at +-448."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_E4M3).float()
    grid = grid[grid.isfinite()].unique()  # sorted, the 253 distinct finite values
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    x = torch.cat([grid, mids, near, torch.tensor([448.0, 449.0, 464.0, 1e6, -1e6, 2.0**-10, 2.0**-11, 1e-30, 0.0])])
    x = torch.cat([x, torch.zeros((-x.numel()) % 16)]).view(-1, 1, 16)  # tokens of one head of 16
    cache = torch.zeros((1, x.shape[0], 1, 16), dtype=FP8_E4M3, device=DEVICE)
    v_cache = cache.clone()
    slots = torch.arange(x.shape[0], device=DEVICE)
    store(x.to(DEVICE), x.to(DEVICE), cache, v_cache, slots)
    expected = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3).view(1, -1, 1, 16)
    assert torch.equal(_bytes(cache), _bytes(expected))


# --------------------------------------------------------------------------- attention
def _decode_case(g, d, bs, dtype, seed=0):
    kv = PagedKV([1, bs - 1, bs + 1, 2 * bs + 5, 0, 3 * bs + 7, 97], HKV, d, bs, dtype, seed=seed, num_layers=2)
    query = torch.randn((len(kv.seq_lens), HKV * g, d), generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return kv, _fp8_pool(kv), query.to(DEVICE)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dname)
def test_attention_references_are_model_dtype_attention_on_the_dequantized_pool(dtype, k_scale, v_scale):
    kv, pool, query = _decode_case(3, 64, 16, dtype)
    k8, v8 = pool[1, 0], pool[1, 1]
    k, v = dequantize(k8, k_scale, dtype), dequantize(v8, v_scale, dtype)
    out = paged_attention_decode_torch(query, k8, v8, kv.block_tables, kv.seq_lens_t, 0.125, k_scale=k_scale,
                                       v_scale=v_scale)
    torch.testing.assert_close(out, paged_attention_decode_torch(query, k, v, kv.block_tables, kv.seq_lens_t, 0.125),
                               rtol=0, atol=0)
    qsl = torch.tensor([0, 1, 5, 9, 20, 20, 30, 31], dtype=torch.int32, device=DEVICE)
    q = torch.randn((31, HKV * 3, 64)).to(dtype).to(DEVICE)
    out = paged_attention_prefill_torch(q, k8, v8, kv.block_tables, kv.seq_lens_t, qsl, 0.125, k_scale=k_scale,
                                        v_scale=v_scale)
    torch.testing.assert_close(out, paged_attention_prefill_torch(q, k, v, kv.block_tables, kv.seq_lens_t, qsl, 0.125),
                               rtol=0, atol=0)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("window", [0, 21])
# CPU: each specialised copy of the C item (head_dim 64 / block 16 with 1-4 query heads per KV head, 128, any
# multiple of 16 and blocks of 32) and the portable one (head_dim 72)
@pytest.mark.parametrize("g,d,bs,dtype", [(1, 64, 16, torch.float32), (3, 64, 16, torch.bfloat16),
                                          (4, 128, 16, torch.float32), (2, 80, 32, torch.bfloat16),
                                          (2, 72, 16, torch.float32)],
                         ids=lambda v: dname(v) if isinstance(v, torch.dtype) else str(v))
@pytest.mark.parametrize("decode", list(DECODES.values()), ids=list(DECODES))
def test_decode_matches_the_reference(decode, g, d, bs, dtype, window, k_scale, v_scale):
    kv, pool, query = _decode_case(g, d, bs, dtype, seed=g + d)
    for layer in (0, 1):  # layer 1: views at an offset, with the pool's strides
        k8, v8 = pool[layer, 0], pool[layer, 1]
        out = decode(query, k8, v8, kv.block_tables, kv.seq_lens_t, d**-0.5, window=window, k_scale=k_scale,
                     v_scale=v_scale)
        ref = paged_attention_decode_torch(query, k8, v8, kv.block_tables, kv.seq_lens_t, d**-0.5, window=window,
                                           k_scale=k_scale, v_scale=v_scale)
        assert out.dtype == dtype and not out.isnan().any()  # no read of a poisoned slot
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("g,d,bs,dtype", [(1, 64, 16, torch.float32), (3, 64, 16, torch.bfloat16),
                                          (4, 128, 8, torch.float32)],
                         ids=lambda v: dname(v) if isinstance(v, torch.dtype) else str(v))
@pytest.mark.parametrize("prefill", list(PREFILLS.values()), ids=list(PREFILLS))
def test_prefill_matches_the_reference(prefill, g, d, bs, dtype, k_scale, v_scale):
    kv, pool, _ = _decode_case(g, d, bs, dtype, seed=g * d)
    # queries: the last q_len positions of each sequence (one with none, one whole, chunks after a prefix)
    q_lens = [1, bs - 1, 3, 2 * bs + 5, 0, 20, 50]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    query = torch.randn((sum(q_lens), HKV * g, d)).to(dtype).to(DEVICE)
    k8, v8 = pool[1, 0], pool[1, 1]
    out = prefill(query, k8, v8, kv.block_tables, kv.seq_lens_t, qsl, d**-0.5, k_scale=k_scale, v_scale=v_scale)
    ref = paged_attention_prefill_torch(query, k8, v8, kv.block_tables, kv.seq_lens_t, qsl, d**-0.5, k_scale=k_scale,
                                        v_scale=v_scale)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_avx2_build_decodes_as_the_reference(tmp_path_factory, dtype):
    """The 8-lane (AVX2 + F16C) item an AVX-512 build never runs."""
    lib = avx2_kernels(tmp_path_factory.mktemp("avx2-fp8"))
    for g, d, bs in ((3, 64, 16), (4, 128, 16), (2, 72, 8), (1, 32, 32)):
        kv, pool, query = _decode_case(g, d, bs, dtype, seed=d)
        k8, v8 = pool[1, 0], pool[1, 1]
        out = _decode(lib.decode_fp8_for(dtype), query, k8, v8, kv.block_tables, kv.seq_lens_t, d**-0.5, 0, 0.5, 4.0)
        ref = paged_attention_decode_torch(query, k8, v8, kv.block_tables, kv.seq_lens_t, d**-0.5, k_scale=0.5,
                                           v_scale=4.0)
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_fp8_attention_is_close_to_model_dtype_attention(dtype):
    """The same K and V in an fp8 pool and a model-dtype one. e4m3 keeps 3 mantissa bits: every stored value is
    within 2^-4 of its own magnitude, so scores of unit-variance q, k (scale 1/sqrt(D)) move by ~2^-4 and each
    output, a convex mix of V rows, by about that times |V| (~1 here): 0.1 bounds every element, and the mean
    error stays below 2^-6 (measured ~0.005 in both dtypes)."""
    for decode, prefill in ((paged_attention_decode_torch, paged_attention_prefill_torch),
                            (paged_attention_decode_cpu, paged_attention_prefill_cpu)):
        kv = PagedKV([40, 97, 130], HKV, 64, 16, dtype, seed=7)
        # zeros, not poison, past the sequences: the reference's CPU path for a batch sharing little multiplies
        # whole blocks (masked probabilities of 0 times a NaN are NaN); the engine's pool is zeroed likewise
        kv.kv_cache = kv.kv_cache.nan_to_num(0.0)
        pool = kv.kv_cache.to(DEVICE)
        q = torch.randn((3, HKV * 3, 64), generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
        exact = decode(q, pool[0, 0], pool[0, 1], kv.block_tables, kv.seq_lens_t, 0.125)
        fp8 = decode(q, *_fp8_pool(kv)[0], kv.block_tables, kv.seq_lens_t, 0.125)
        err = (fp8.float() - exact.float()).abs()
        assert err.max() < 0.1 and err.mean() < 2.0**-6, (err.max(), err.mean())
        qsl = torch.tensor([0, 10, 60, 90], dtype=torch.int32, device=DEVICE)
        qp = torch.randn((90, HKV * 3, 64), generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
        exact = prefill(qp, pool[0, 0], pool[0, 1], kv.block_tables, kv.seq_lens_t, qsl, 0.125)
        fp8 = prefill(qp, *_fp8_pool(kv)[0], kv.block_tables, kv.seq_lens_t, qsl, 0.125)
        err = (fp8.float() - exact.float()).abs()
        assert err.max() < 0.1 and err.mean() < 2.0**-6, (err.max(), err.mean())


# --------------------------------------------------------------------------- copy_blocks, the op set
@pytest.mark.parametrize("rows", [3, 80])  # 80: past the reference's per-row loop (index_copy_ on the bytes)
@pytest.mark.parametrize("copy", [copy_blocks_torch, pytest.param(copy_blocks_triton, marks=needs_triton)],
                         ids=["torch", "triton"])
def test_copy_blocks_copies_fp8_blocks(copy, rows):
    pool = quantize(torch.randn((2, 2, 2 * rows + 1, 4, 2, 16)), 1.0).to(DEVICE)
    mapping = torch.stack([torch.arange(rows), torch.arange(rows, 2 * rows)], dim=1).to(DEVICE)
    expected = pool.clone()
    expected[:, :, rows:2 * rows] = pool[:, :, :rows]
    copy(pool, mapping)
    assert torch.equal(_bytes(pool), _bytes(expected))


def test_kv_cache_dtypes_and_the_op_sets():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.float32) == kv_cache_torch_dtype("fp8_e4m3", torch.float32) == FP8_E4M3
    with pytest.raises(ValueError, match="fp8_e4m3"):
        kv_cache_torch_dtype("int8", torch.float32)
    ref = reference_ops()
    assert kv_cache_ops(ref, torch.float32, torch.float32) is ref
    assert kv_cache_ops(ref, FP8_E4M3, torch.float32) is ref  # the references read either pool


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_bound_cpu_ops_store_and_attend_as_the_launchers(dtype):
    """fp8_cpu_ops binds the C kernels on raw pointers (the model runner's tensors): the same bytes and outputs."""
    from kernels.cpu.ops import checked_cpu_ops

    ops = fp8_cpu_ops(checked_cpu_ops(), dtype)
    if _native.native_kernels() is not None:
        assert ops.store_kv is not store_kv_cpu  # bound, not the checking launcher
    key, value, cache, slots = _store_case(3, 64, 16, dtype)
    ref = cache.clone()
    store_kv_cpu(key, value, ref[0, 0], ref[0, 1], slots, k_scale=0.5, v_scale=2.0)
    ops.store_kv(key, value, cache[0, 0], cache[0, 1], slots, k_scale=0.5, v_scale=2.0)
    assert torch.equal(_bytes(cache), _bytes(ref))
    kv, pool, query = _decode_case(3, 64, 16, dtype)
    args = (query, pool[1, 0], pool[1, 1], kv.block_tables, kv.seq_lens_t, 0.125)
    torch.testing.assert_close(ops.paged_attention_decode(*args, k_scale=0.5, v_scale=2.0),
                               paged_attention_decode_cpu(*args, k_scale=0.5, v_scale=2.0), rtol=0, atol=0)
