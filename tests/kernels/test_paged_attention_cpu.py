"""The CPU C kernels for decode and prefill attention against the torch references and naive float64 attention.

Poisoned caches (NaN in every slot past a sequence, padded block tables with a NaN block or -1)
make any read past seq_len show up as NaN in the output.
"""
import ctypes
import dataclasses
import itertools
import shutil

import pytest
import torch
from kernels_testlib import TOL, PagedKV, avx2_kernels, naive_attention

import kernels
from kernels.cpu import native as _native
from kernels.cpu.paged_attention import paged_attention_decode_cpu, paged_attention_prefill_cpu
from kernels.cpu.scratch import Scratch
from kernels.paged_attention_decode import paged_attention_decode_torch
from kernels.paged_attention_prefill import paged_attention_prefill_torch

HKV = 2


@pytest.fixture(scope="module", params=["native", "avx2"])
def native(request, tmp_path_factory):
    """The library as the engine builds it (-march=native), then built for AVX2 only (-march=x86-64-v3), as
    on an AVX2-only CPU: its 8-lane flash item, decode item and shared-prefix threshold, which an AVX-512
    build (CI's) never runs. The second is used as the launchers would on such a CPU."""
    lib = _native.native_kernels()
    if lib is None and _native._compiler() is not None:
        pytest.fail("a C compiler is present but the CPU kernels did not build (see the warning log)")
    if lib is None:
        pytest.skip("no C compiler on this machine: the CPU backend falls back to the torch path")
    if request.param == "native":
        yield lib
        return
    avx2 = avx2_kernels(tmp_path_factory.mktemp("avx2"))
    import kernels.cpu.paged_attention as launchers

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launchers, "native_kernels", lambda: avx2)
        for mod in (launchers, _native):
            mp.setattr(mod, "cpu_has_avx512", lambda: False)
        mp.setattr(_native, "cpu_has_bf16_pairs", lambda: False)
        yield avx2


def _lens(bs):
    return [1, bs - 1, bs, bs + 1, 2 * bs + 5, 0, 3 * bs + 7, 97]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Covers each specialised copy (AVX-512 or AVX2: head_dim 64 / block 16 with 1-4 query heads per KV head,
# head_dim 128, any multiple of 16 (AVX2: 8) incl. blocks of 32 = two tiles; portable: other head_dims).
@pytest.mark.parametrize("g,d,bs", [(1, 64, 16), (2, 64, 16), (3, 64, 16), (4, 64, 16), (3, 128, 16), (4, 32, 8),
                                    (2, 80, 32), (8, 64, 16), (2, 72, 16), (16, 64, 128)])
def test_cpu_kernel_matches_naive_and_reference(native, g, d, bs, dtype):
    kv = PagedKV(_lens(bs), HKV, d, bs, dtype, seed=g + d + bs, num_layers=2)
    query = torch.randn((len(kv.seq_lens), HKV * g, d), generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = d**-0.5
    for layer in (0, 1):  # layer 1: cache views with a non-zero offset and the pool's strides
        k_cache, v_cache = kv.caches(layer)
        out = paged_attention_decode_cpu(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, scale)
        assert out.shape == query.shape and out.dtype == dtype
        ref = paged_attention_decode_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, scale)
        torch.testing.assert_close(out, ref, **TOL[dtype])
        for s, n in enumerate(kv.seq_lens):
            if n == 0:
                assert torch.all(out[s] == 0)
                continue
            exp = naive_attention(query[s : s + 1], kv.k[s][layer], kv.v[s][layer], scale, [n - 1])
            torch.testing.assert_close(out[s : s + 1].double(), exp, **TOL[dtype])


@pytest.mark.parametrize("window", [0, 21])
@pytest.mark.parametrize("g,d,bs", [(1, 64, 16), (3, 64, 16), (4, 128, 16), (3, 32, 8), (8, 64, 32)])
def test_bf16_decode_within_the_pair_products_bound(native, g, d, bs, window):
    """bfloat16 decode per sequence with AVX512-BF16 runs both products on bf16 pairs (q and K as they are,
    V rows interleaved two positions at a time, the probabilities rounded to bfloat16): every output within
    the prefill items' bound of naive float64 attention. Odd lengths pair their last V row with zeros (the
    poisoned slot after it would be NaN), and a window starting inside a block masks the keys before it."""
    kv = PagedKV(_lens(bs), HKV, d, bs, torch.bfloat16, seed=7 * g + d + bs + window)
    query = torch.randn((len(kv.seq_lens), HKV * g, d), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = paged_attention_decode_cpu(query, *kv.caches(), kv.block_tables, kv.seq_lens_t, d**-0.5, window)
    for s, n in enumerate(kv.seq_lens):
        if n == 0:
            continue
        lo = max(0, n - window) if window else 0
        naive = naive_attention(query[s : s + 1], kv.k[s][0][lo:], kv.v[s][0][lo:], d**-0.5, [n - 1 - lo])
        assert ((out[s : s + 1].double() - naive).abs() <= _bf16_prefill_bound(naive, kv, 0)).all(), s


def test_int64_tables_and_strided_query(native):
    kv = PagedKV([5, 40, 17], HKV, 64, 16, torch.float32, seed=3)
    wide = torch.randn(3, HKV * 3, 128)
    query = wide[:, :, :64]  # last dim contiguous, rows strided
    args = (*kv.caches(), kv.block_tables.long(), kv.seq_lens_t.long(), 0.125)
    torch.testing.assert_close(
        paged_attention_decode_cpu(query, *args), paged_attention_decode_torch(query, *args), **TOL[torch.float32]
    )


def test_shared_prefix_batches_run_in_the_c_kernel(native, monkeypatch):
    """Sequences sharing blocks (forks, beams) read them through the C kernel too (measured faster)."""
    kv = PagedKV([33, 20], HKV, 64, 16, torch.float32, seed=4)
    kv.kv_cache.nan_to_num_(0.0)  # the reference's shared-block path reads whole blocks (finite in an engine)
    tables = kv.block_tables.clone()
    tables[1, :2] = tables[0, :2]  # both start with the same two blocks
    query = torch.randn(2, HKV * 3, 64)
    import kernels.cpu.paged_attention as mod

    calls = []
    monkeypatch.setattr(mod, "paged_attention_decode_torch", lambda *a: calls.append(a) or paged_attention_decode_torch(*a))
    out = paged_attention_decode_cpu(query, *kv.caches(), tables, kv.seq_lens_t, 0.125)
    assert calls == []
    ref = paged_attention_decode_torch(query, *kv.caches(), tables, kv.seq_lens_t, 0.125)
    torch.testing.assert_close(out, ref)


def _shared_prefix_case(g, d, bs, dtype, members, seed=0, growth=0.0):
    """A poisoned pool where `members` sequences start with the same 11 blocks (half of them the same
    14), 3 share 4 other blocks, and 2 share nothing; each has its own tail of 1-40 tokens. Returns (k_cache, v_cache,
    block_tables, seq_lens, query, naive float64 output)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = torch.randperm(600, generator=gen).tolist()
    k = torch.full((600, bs, HKV, d), float("nan"))
    v = torch.full((600, bs, HKV, d), float("nan"))
    prefix_a, prefix_a2, prefix_b = rnd[:11], rnd[11:14], rnd[14:18]
    free = iter(rnd[18:])
    heads = [prefix_a] * (members // 2) + [prefix_a + prefix_a2] * (members - members // 2) + [prefix_b] * 3 + [[], []]
    tables, lens, written = [], [], set()
    for i, head in enumerate(heads):
        tail = 1 + (7 * i) % 40
        n = len(head) * bs + tail
        table = head + [next(free) for _ in range(-(-tail // bs))]
        tables.append(table)
        lens.append(n)
    width = max(map(len, tables)) + 1
    keys = {}  # block id -> (K, V) rows it holds, written once even when shared
    for table, n in zip(tables, lens):
        for j, blk in enumerate(table):
            if blk not in keys:
                rows = min(bs, n - j * bs)
                # growth: K rows scaled up along positions, so later keys raise the running max
                grow = 1 + growth * torch.arange(j * bs, j * bs + rows, dtype=torch.float32)[:, None, None]
                keys[blk] = (torch.randn((rows, HKV, d), generator=gen) * grow, torch.randn((rows, HKV, d), generator=gen))
                k[blk, :rows], v[blk, :rows] = keys[blk]
    k, v = k.to(dtype), v.to(dtype)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn((len(lens), HKV * g, d), generator=gen).to(dtype)
    naive = torch.empty(query.shape, dtype=torch.float64)
    for s, (table, n) in enumerate(zip(tables, lens)):
        ks = torch.cat([k[blk, :min(bs, n - j * bs)] for j, blk in enumerate(table)])
        vs = torch.cat([v[blk, :min(bs, n - j * bs)] for j, blk in enumerate(table)])
        naive[s] = naive_attention(query[s:s + 1], ks, vs, d**-0.5, [n - 1])[0]
    return k, v, block_tables, seq_lens, query, naive


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_with_scores_growing_along_the_keys(native, dtype):
    """Keys that grow along the prefix raise each row's max on later steps: the items' rescaling of what
    they summed before (on AMX, of the output tiles) is exercised, not only their first step."""
    k, v, tables, lens, query, naive = _shared_prefix_case(3, 64, 16, dtype, 8, seed=5, growth=0.05)
    out = paged_attention_decode_cpu(query, k, v, tables, lens, 64**-0.5, scratch=Scratch())
    torch.testing.assert_close(out.double(), naive, **TOL[dtype])


def _shared_groups(native, block_tables, seq_lens, hq, d, bs, dtype, window=0) -> int:
    lib = ctypes.CDLL(str(native.path))
    lib.ps_decode_shared_groups.restype = ctypes.c_int64
    return lib.ps_decode_shared_groups(ctypes.c_void_p(block_tables.data_ptr()), ctypes.c_void_p(seq_lens.data_ptr()),
                                       ctypes.c_int64(len(seq_lens)), ctypes.c_int64(hq), ctypes.c_int64(HKV),
                                       ctypes.c_int64(d), ctypes.c_int64(bs), ctypes.c_int64(block_tables.stride(0)),
                                       ctypes.c_int64(window), ctypes.c_int64(dtype == torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g,d,bs", [(3, 64, 16), (4, 128, 16), (2, 80, 8), (8, 64, 32), (3, 64, 64)])
def test_shared_prefix_attended_once_matches_naive(native, g, d, bs, dtype):
    """A prefix shared by enough query rows (members x G >= 16) is attended by the flash items once for
    all of them (its keys rounded down to 16: with blocks of 8, the sequences go on from inside a block),
    each sequence then goes on over its own keys from their softmax state (AVX-512 or AVX2 only); too few
    rows (3 sequences at G < 6), too few keys (< 64) or none shared: the per-sequence item."""
    k, v, tables, lens, query, naive = _shared_prefix_case(g, d, bs, dtype, 8, seed=g + d + bs)
    flash = _native.cpu_has_avx512() or _native.cpu_has_avx2()
    expected = (1 + (3 * g >= 16 and 4 * bs >= 64)) if flash else 0
    assert _shared_groups(native, tables, lens, HKV * g, d, bs, dtype) == expected
    assert _shared_groups(native, tables, lens, HKV * g, d, bs, dtype, window=4096) == 0  # windows: per sequence
    scratch = Scratch()
    out = paged_attention_decode_cpu(query, k, v, tables, lens, d**-0.5, scratch=scratch)
    torch.testing.assert_close(out.double(), naive, **TOL[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), naive, atol=2e-5, rtol=2e-5)
    # the kernel asked for scratch exactly when it had groups; a second call reuses it
    assert (scratch.floats > 0) == (expected > 0)
    before = scratch.floats
    torch.testing.assert_close(paged_attention_decode_cpu(query, k, v, tables, lens, d**-0.5, scratch=scratch), out,
                               atol=0, rtol=0)
    assert scratch.floats == before


def test_scratch_grows_and_keeps_its_memory():
    scratch = Scratch()
    a = scratch.take(100)
    assert a.numel() == 100 and a.dtype == torch.float32 and scratch.floats == 100
    b = scratch.take(50)  # smaller: the same memory
    assert b.data_ptr() == a.data_ptr() and b.numel() == 50
    c = scratch.take(101)  # larger: grows with headroom
    assert c.numel() == 101 and scratch.floats >= 125


def test_float16_falls_back_to_reference(native):
    kv = PagedKV([9, 30], HKV, 64, 16, torch.float16, seed=5)
    kv.kv_cache.nan_to_num_(0.0)
    query = torch.randn(2, HKV * 2, 64).half()
    args = (*kv.caches(), kv.block_tables, kv.seq_lens_t, 0.125)
    torch.testing.assert_close(paged_attention_decode_cpu(query, *args), paged_attention_decode_torch(query, *args))


def test_bad_block_ids_raise_instead_of_reading_outside_the_pool(native):
    kv = PagedKV([20, 9], HKV, 64, 16, torch.float32, seed=6)
    tables = kv.block_tables.clone()
    tables[0, 1] = kv.num_blocks + 7
    query = torch.randn(2, HKV, 64)
    with pytest.raises(IndexError, match="block ids outside"):
        paged_attention_decode_cpu(query, *kv.caches(), tables, kv.seq_lens_t, 0.125)
    too_long = torch.tensor([20, 16 * kv.max_blocks + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs"):
        paged_attention_decode_cpu(query, *kv.caches(), kv.block_tables, too_long, 0.125)


def test_auto_backend_on_cpu_is_the_cpu_set():
    ops = kernels.get_ops("auto", "cpu")
    assert ops.name == "cpu"
    # the bound set hands the launcher its own reusable scratch memory (kernels/cpu/scratch.py)
    assert ops.paged_attention_prefill.func is paged_attention_prefill_cpu is kernels.paged_attention_prefill_cpu
    assert isinstance(ops.paged_attention_prefill.keywords["scratch"], Scratch)
    with pytest.raises(ValueError, match="CPU devices only"):
        kernels.get_ops("cpu", "meta")


def test_switch_off_and_missing_compiler_mean_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv(_native.ENV_SWITCH, "0")
    _native.native_kernels.cache_clear()
    try:
        assert _native.native_kernels() is None
        monkeypatch.delenv(_native.ENV_SWITCH)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached: a build is needed
        monkeypatch.setattr(_native, "_compiler", lambda: None)
        _native.native_kernels.cache_clear()
        assert _native.native_kernels() is None
        kv = PagedKV([9, 30], HKV, 64, 16, torch.float32, seed=7)
        kv.kv_cache.nan_to_num_(0.0)
        query = torch.randn(2, HKV * 2, 64)
        args = (*kv.caches(), kv.block_tables, kv.seq_lens_t, 0.125)
        torch.testing.assert_close(paged_attention_decode_cpu(query, *args), paged_attention_decode_torch(query, *args))
    finally:
        _native.native_kernels.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = _native._build(_native._compiler())
    mtime = first.stat().st_mtime_ns
    assert _native._build(_native._compiler()) == first and first.stat().st_mtime_ns == mtime
    assert first.is_relative_to(tmp_path / "prefixserve" / "kernels")
    assert [p.name for p in first.parent.iterdir()] == ["libprefixserve_cpu.so"]  # no temp files left


# --------------------------------------------------------------------------- prefill


def _prefill_case(shapes, hkv, g, d, bs, dtype=torch.float32, seed=0, num_layers=1):
    """A poisoned paged cache for (q_len, seq_len) per sequence, queries and query_start_loc."""
    kv = PagedKV([n for _, n in shapes], hkv, d, bs, dtype, seed=seed, num_layers=num_layers)
    qsl = [0]
    for q_len, _ in shapes:
        qsl.append(qsl[-1] + q_len)
    query = torch.randn((qsl[-1], hkv * g, d), generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return kv, query, torch.tensor(qsl, dtype=torch.int32)


def _naive_prefill(kv, query, qsl, scale, layer=0):
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s, n in enumerate(kv.seq_lens):
        q0, q1 = int(qsl[s]), int(qsl[s + 1])
        if q1 > q0:
            out[q0:q1] = naive_attention(query[q0:q1], kv.k[s][layer], kv.v[s][layer], scale, range(n - (q1 - q0), n))
    return out


def _prefill_shapes(bs):
    """Fresh prompts, cached prefixes, chunks, single tokens, a sequence without queries, and rows
    that fill several 32-row work items (a partial last one included)."""
    return [(1, 1), (bs + 3, bs + 3), (5, 2 * bs + 3), (0, 4), (bs, 3 * bs), (1, bs + 1), (70, 70), (33, 130)]


@pytest.fixture
def c_prefill(monkeypatch):
    """Prefill takes the C kernel as on a CPU with AVX-512, whatever this machine has."""
    import kernels.cpu.paged_attention as mod

    monkeypatch.setattr(mod, "cpu_has_avx512", lambda: True)


@pytest.fixture
def kernel_only(c_prefill, monkeypatch):
    """Any call that would reach the reference fails, and bfloat16 takes the kernel as on a CPU
    with AVX-512 and without AMX (where it does in production), whatever this machine has: the
    portable build (AVX2) computes the same, only slower than torch's flash attention."""
    import kernels.cpu.paged_attention as mod

    monkeypatch.setattr(mod, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(mod, "paged_attention_prefill_torch", lambda *a: pytest.fail("reached the reference"))


def test_prefill_without_avx512_or_avx2_takes_the_torch_path(native, monkeypatch):
    """Without AVX-512 or AVX2 the kernel's portable item (16-lane vector types that split badly) measured
    ~10x slower than torch's flash attention on an AVX2 CPU, so production prefill goes to the reference."""
    import kernels.cpu.paged_attention as mod

    kv, query, qsl = _prefill_case(_prefill_shapes(16), HKV, 3, 64, 16, seed=5)
    calls = []
    monkeypatch.setattr(mod, "cpu_has_avx512", lambda: False)
    monkeypatch.setattr(mod, "cpu_has_avx2", lambda: False)
    monkeypatch.setattr(mod, "paged_attention_prefill_torch",
                        lambda *a: calls.append(1) or paged_attention_prefill_torch(*a))
    paged_attention_prefill_cpu(query, *kv.caches(), kv.block_tables, kv.seq_lens_t, qsl, 0.125)
    assert calls == [1]


# Every query-heads-per-KV-head count the items must split (1, 3, 16 rows per query), head dims the
# kernel specialises (64, 128) or not (32, 80, 256 = its limit), and blocks smaller, equal to and
# larger than its 16-key tiles; bfloat16 is float32 math on widened operands, rounded once.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (AMX: head_dim 64 reads K in place from blocks of 16 or 32, from gathered rows with blocks of 8.)
@pytest.mark.parametrize("g,d,bs", [(1, 64, 16), (3, 64, 16), (4, 128, 32), (2, 80, 8), (8, 32, 16),
                                    (3, 256, 16), (16, 64, 8), (5, 72, 32), (3, 64, 32)])
def test_cpu_prefill_matches_naive_and_reference(native, kernel_only, g, d, bs, dtype):
    kv, query, qsl = _prefill_case(_prefill_shapes(bs), HKV, g, d, bs, dtype=dtype, seed=g + d + bs, num_layers=2)
    scale = d**-0.5
    for layer in (0, 1):  # layer 1: cache views with a non-zero offset and the pool's strides
        k_cache, v_cache = kv.caches(layer)
        out = paged_attention_prefill_cpu(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, scale)
        assert out.shape == query.shape and out.dtype == dtype
        ref = paged_attention_prefill_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, scale)
        torch.testing.assert_close(out, ref, **TOL[dtype])
        naive = _naive_prefill(kv, query, qsl, scale, layer)
        torch.testing.assert_close(out.double(), naive, **TOL[dtype])
        if dtype == torch.bfloat16:
            assert ((out.double() - naive).abs() <= _bf16_prefill_bound(naive, kv, layer)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g,d,bs", [(3, 64, 16), (4, 128, 32), (2, 80, 8), (3, 64, 64)])
def test_cpu_prefill_over_shared_blocks_matches_naive(native, kernel_only, g, d, bs, dtype):
    """Questions under one cached system prompt (sequences whose leading block ids are the same, some
    sharing more blocks than others, besides sequences sharing nothing) in one prefill: float32 items read
    the shared blocks in place from the poisoned pool, the rest from the gathered rows; either way every
    query matches the naive attention over its own sequence's keys."""
    k, v, tables, lens, _, _ = _shared_prefix_case(g, d, bs, dtype, 8, seed=g + d + bs)
    q_lens = [min(int(n), 1 + (5 * i) % 37) for i, n in enumerate(lens)]
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    query = torch.randn((int(qsl[-1]), HKV * g, d), generator=torch.Generator().manual_seed(7)).to(dtype)
    out = paged_attention_prefill_cpu(query, k, v, tables, lens, qsl, d**-0.5)
    for s, (table, n) in enumerate(zip(tables.tolist(), lens.tolist())):
        ks = torch.cat([k[blk, :min(bs, n - j * bs)] for j, blk in enumerate(table[: -(-n // bs)])])
        vs = torch.cat([v[blk, :min(bs, n - j * bs)] for j, blk in enumerate(table[: -(-n // bs)])])
        q0, q1 = int(qsl[s]), int(qsl[s + 1])
        naive = naive_attention(query[q0:q1], ks, vs, d**-0.5, range(n - (q1 - q0), n))
        torch.testing.assert_close(out[q0:q1].double(), naive, **TOL[dtype])


def _bf16_prefill_bound(naive, kv, layer):
    """The float32 result rounds once to bfloat16: half an ulp, at most 2^-8 of it. With AVX512-BF16 the
    probabilities also round to bfloat16 before P.V (each by at most 2^-9 of itself; they sum to the
    softmax's denominator), which moves an output by at most 2^-9 of the largest |V| it reads."""
    bound = naive.abs() * 2.0**-8 + 1e-6
    if _native.cpu_has_bf16_pairs():
        bound = bound + 2.0**-9 * max(float(v[layer].abs().max()) for v in kv.v if v[layer].numel())
    return bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_with_scores_growing_along_the_keys(native, kernel_only, dtype):
    """As test_shared_prefix_with_scores_growing_along_the_keys, for prefill: later keys raise the
    running max after the first steps of every item."""
    kv, query, qsl = _prefill_case([(70, 70), (33, 130), (5, 200)], HKV, 3, 64, 16, dtype=dtype, seed=11)
    for s, n in enumerate(kv.seq_lens):
        grow = (1 + 0.05 * torch.arange(n, dtype=torch.float32))[None, :, None, None]
        kv.k[s] = (kv.k[s].float() * grow).to(dtype)
        for p in range(n):
            kv.kv_cache[:, 0, kv.tables[s][p // 16], p % 16] = kv.k[s][:, p]
    out = paged_attention_prefill_cpu(query, *kv.caches(), kv.block_tables, kv.seq_lens_t, qsl, 0.125)
    naive = _naive_prefill(kv, query, qsl, 0.125)
    torch.testing.assert_close(out.double(), naive, **TOL[dtype])
    if dtype == torch.bfloat16:
        assert ((out.double() - naive).abs() <= _bf16_prefill_bound(naive, kv, 0)).all()


@pytest.mark.parametrize("seed", range(6))
def test_cpu_prefill_random_batches(native, c_prefill, seed):
    """Random batches as the scheduler makes them: mixed chunk sizes after random cached prefixes."""
    rnd = torch.Generator().manual_seed(seed)
    shapes = []
    for _ in range(int(torch.randint(1, 7, (1,), generator=rnd))):
        q_len = int(torch.randint(0, 90, (1,), generator=rnd))
        shapes.append((q_len, q_len + int(torch.randint(0, 60, (1,), generator=rnd)) + (q_len == 0)))
    hkv, g = [(1, 8), (3, 3), (2, 4)][seed % 3]
    kv, query, qsl = _prefill_case(shapes, hkv, g, 64, 16, seed=seed)
    args = (query, *kv.caches(), kv.block_tables, kv.seq_lens_t, qsl, 0.125)
    torch.testing.assert_close(paged_attention_prefill_cpu(*args), paged_attention_prefill_torch(*args),
                               **TOL[torch.float32])


def test_cpu_prefill_int64_metadata_and_strided_query(native, c_prefill):
    kv, _, qsl = _prefill_case([(20, 20), (7, 40)], HKV, 3, 64, 16, seed=8)
    qkv = torch.randn(27, HKV * 3 + 2 * HKV, 64)
    query = qkv[:, : HKV * 3]  # the model's q: a strided view of the qkv projection
    args = (query, *kv.caches(), kv.block_tables.long(), kv.seq_lens_t.long(), qsl.long(), 0.125)
    torch.testing.assert_close(paged_attention_prefill_cpu(*args), paged_attention_prefill_torch(*args),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_query_rows_at_odd_element_offsets(native, kernel_only, dtype):
    """A query view whose head stride is odd (a width of 65 cut to 64): each row starts at an odd element,
    which the items' query loads (16 rows turned over in registers) must read where it lies."""
    kv, _, qsl = _prefill_case([(20, 40), (17, 17)], HKV, 3, 64, 16, dtype=dtype, seed=9)
    wide = torch.randn((37, HKV * 3, 65), generator=torch.Generator().manual_seed(3)).to(dtype)
    query = wide[:, :, :64]
    assert query.stride(1) % 2 == 1
    out = paged_attention_prefill_cpu(query, *kv.caches(), kv.block_tables, kv.seq_lens_t, qsl, 0.125)
    ref = paged_attention_prefill_torch(query, *kv.caches(), kv.block_tables, kv.seq_lens_t, qsl, 0.125)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.float16, 64), (torch.float32, 36)])
def test_cpu_prefill_falls_back_to_reference(native, monkeypatch, dtype, d):
    """bfloat16 on an AMX CPU from a library without the AMX item (SDPA's AMX products are faster than
    the AVX-512 items), float16, and head dims the kernel does not take."""
    import kernels.cpu.paged_attention as mod

    monkeypatch.setattr(mod, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(mod, "native_kernels", lambda: dataclasses.replace(native, prefill_amx=False))
    calls = []
    monkeypatch.setattr(mod, "paged_attention_prefill_torch",
                        lambda *a: calls.append(a) or paged_attention_prefill_torch(*a))
    kv, query, qsl = _prefill_case([(9, 9), (4, 30)], HKV, 2, d, 16, dtype=dtype, seed=9)
    out = paged_attention_prefill_cpu(query, *kv.caches(), kv.block_tables, kv.seq_lens_t, qsl, 0.125)
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), _naive_prefill(kv, query, qsl, 0.125), **TOL[dtype])


def test_cpu_prefill_bad_block_ids_raise_and_idle_sequences_are_not_read(native, c_prefill):
    kv, query, qsl = _prefill_case([(20, 20), (0, 9), (3, 9)], HKV, 3, 64, 16, seed=10)
    tables = kv.block_tables.clone()
    tables[1, 0] = -5  # the sequence without queries is never read: no error, as in the reference
    args = (query, *kv.caches(), tables, kv.seq_lens_t, qsl, 0.125)
    torch.testing.assert_close(paged_attention_prefill_cpu(*args), paged_attention_prefill_torch(*args))
    tables[0, 1] = kv.num_blocks + 3
    with pytest.raises(IndexError, match="block ids outside"):
        paged_attention_prefill_cpu(query, *kv.caches(), tables, kv.seq_lens_t, qsl, 0.125)


def test_cpu_prefill_empty_and_no_queries(native, c_prefill):
    kv, query, qsl = _prefill_case([(0, 5), (0, 3)], HKV, 2, 64, 16, seed=11)
    out = paged_attention_prefill_cpu(query, *kv.caches(), kv.block_tables, kv.seq_lens_t, qsl, 0.125)
    assert out.shape == (0, HKV * 2, 64)
