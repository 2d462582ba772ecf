import pytest
import torch
from kernels_testlib import DEVICE, HAS_TRITON, TOL, PagedKV, config_grid, naive_attention, needs_triton, poison_outputs

from kernels.paged_attention_decode import _launch, paged_attention_decode_torch, paged_attention_decode_triton

HKV = 2


def _seq_lens(bs):
    # ragged: 1, around block boundaries, several blocks, not a multiple of the block size
    return [1, bs - 1, bs, bs + 1, 2 * bs + 5, 3 * bs + 7]


def _case(g, d, bs, dtype, seed=0, num_layers=1, hkv=HKV):
    kv = PagedKV(_seq_lens(bs), hkv, d, bs, dtype, seed=seed, num_layers=num_layers)
    gen = torch.Generator().manual_seed(seed + 100)
    query = torch.randn((len(kv.seq_lens), hkv * g, d), generator=gen).to(dtype).to(DEVICE)
    return kv, query, d**-0.5


def _naive_decode(kv, query, scale, layer=0):
    outs = []
    for s, n in enumerate(kv.seq_lens):
        outs.append(naive_attention(query[s : s + 1], kv.k[s][layer], kv.v[s][layer], scale, [n - 1]))
    return torch.cat(outs)


@pytest.mark.parametrize("g,d,bs,dtype", config_grid())
def test_reference_matches_naive(g, d, bs, dtype):
    kv, query, scale = _case(g, d, bs, dtype)
    k_cache, v_cache = kv.caches()
    out = paged_attention_decode_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, scale)
    assert out.shape == query.shape and out.dtype == dtype
    expected = _naive_decode(kv, query, scale)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[dtype])


@pytest.mark.parametrize("chunk_bytes", [1, 40_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_chunked_batch(chunk_bytes, dtype, monkeypatch):
    """The CPU path splits big batches into cache-sized groups of sequences (here 1 and ~2-3)."""
    import kernels.paged_attention_decode as mod

    monkeypatch.setattr(mod, "_CPU_CHUNK_BYTES", chunk_bytes)
    kv = PagedKV([1, 9, 0, 40, 3, 17, 33], HKV, 32, 8, dtype, seed=5)
    query = torch.randn((7, HKV * 3, 32)).to(dtype).to(DEVICE)
    out = paged_attention_decode_torch(query, *kv.caches(), kv.block_tables, kv.seq_lens_t, 0.2)
    for s, n in enumerate(kv.seq_lens):
        if n == 0:
            assert torch.all(out[s] == 0)
            continue
        exp = naive_attention(query[s : s + 1], kv.k[s][0], kv.v[s][0], 0.2, [n - 1])
        torch.testing.assert_close(out[s : s + 1].cpu().double(), exp, **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("g,d,bs,dtype", config_grid())
def test_triton_matches_reference(g, d, bs, dtype, monkeypatch):
    poison_outputs(monkeypatch)
    kv, query, scale = _case(g, d, bs, dtype, seed=1)
    k_cache, v_cache = kv.caches()
    ref = paged_attention_decode_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, scale)
    out = paged_attention_decode_triton(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("hkv,g", [(1, 8), (3, 3)], ids=["MQA-1x8", "Hkv3-G3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mqa_and_odd_kv_heads(hkv, g, dtype, monkeypatch):
    """One KV head for all query heads (MQA), and a non power-of-2 KV head count (SmolLM2: 9/3)."""
    poison_outputs(monkeypatch)
    kv, query, scale = _case(g, 64, 16, dtype, seed=6, hkv=hkv)
    k_cache, v_cache = kv.caches()
    ref = paged_attention_decode_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, scale)
    torch.testing.assert_close(ref.cpu().double(), _naive_decode(kv, query, scale), **TOL[dtype])
    if HAS_TRITON:
        out = paged_attention_decode_triton(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, scale)
        torch.testing.assert_close(out, ref, **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (4, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_split_kv_and_tiles(num_splits, block_n, dtype, monkeypatch):
    """Flash-decoding splits (incl. empty splits) and small key tiles give the same result."""
    poison_outputs(monkeypatch)
    kv, query, scale = _case(3, 64, 16, dtype, seed=2)
    k_cache, v_cache = kv.caches()
    ref = paged_attention_decode_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, scale)
    out = _launch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, scale,
                  num_splits=num_splits, block_n=block_n)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_layer_view_strided_query_and_empty_rows(backend, monkeypatch):
    """Layer 1 of a multi-layer cache, a query sliced out of a fused qkv tensor, a seq_len 0 row."""
    poison_outputs(monkeypatch)
    g, d, bs = 2, 32, 8
    kv = PagedKV([5, 0, 17], HKV, d, bs, torch.float32, seed=3, num_layers=2)
    qkv = torch.randn((3, HKV * g + 2 * HKV, d), device=DEVICE)
    query = qkv[:, : HKV * g]
    k_cache, v_cache = kv.caches(layer=1)
    fn = paged_attention_decode_torch if backend == "torch" else paged_attention_decode_triton
    out = fn(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, 0.3)
    for s in (0, 2):
        n = kv.seq_lens[s]
        exp = naive_attention(query[s : s + 1], kv.k[s][1], kv.v[s][1], 0.3, [n - 1])
        torch.testing.assert_close(out[s : s + 1].cpu().double(), exp, atol=1e-5, rtol=1e-5)
    assert torch.all(out[1] == 0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_empty_batch(backend):
    fn = paged_attention_decode_torch if backend == "torch" else paged_attention_decode_triton
    kv = torch.zeros((2, 3, 8, 1, 16), device=DEVICE)
    out = fn(torch.zeros((0, 2, 16), device=DEVICE), kv[0], kv[1],
             torch.zeros((0, 4), dtype=torch.int32, device=DEVICE),
             torch.zeros((0,), dtype=torch.int32, device=DEVICE), 0.25)
    assert out.shape == (0, 2, 16)


def _valid_args():
    kv = torch.zeros((2, 6, 8, 2, 16), device=DEVICE)
    return dict(query=torch.randn((3, 4, 16), device=DEVICE), k_cache=kv[0], v_cache=kv[1],
                block_tables=torch.zeros((3, 2), dtype=torch.int32, device=DEVICE),
                seq_lens=torch.ones((3,), dtype=torch.int32, device=DEVICE), scale=0.25)


_BAD = {
    "query_ndim": lambda a: a.update(query=a["query"][0]),
    "query_dtype": lambda a: a.update(query=a["query"].half()),
    "head_ratio": lambda a: a.update(query=torch.randn((3, 3, 16), device=DEVICE)),
    "head_dim": lambda a: a.update(query=torch.randn((3, 4, 8), device=DEVICE)),
    "query_last_dim_strided": lambda a: a.update(query=torch.randn((3, 4, 32), device=DEVICE)[..., ::2]),
    "cache_shapes": lambda a: a.update(v_cache=torch.zeros((6, 8, 2, 8), device=DEVICE)),
    "cache_last_dim_strided": lambda a: a.update(k_cache=torch.zeros((6, 8, 2, 32), device=DEVICE)[..., ::2]),
    "block_tables_float": lambda a: a.update(block_tables=a["block_tables"].float()),
    "block_tables_rows": lambda a: a.update(block_tables=a["block_tables"][:2]),
    "block_tables_1d": lambda a: a.update(block_tables=a["block_tables"][0]),
    "block_tables_strided": lambda a: a.update(
        block_tables=torch.zeros((3, 4), dtype=torch.int32, device=DEVICE)[:, ::2]),
    "seq_lens_rows": lambda a: a.update(seq_lens=a["seq_lens"][:2]),
    "seq_lens_float": lambda a: a.update(seq_lens=a["seq_lens"].float()),
    "scale_nan": lambda a: a.update(scale=float("nan")),
    "scale_tensor": lambda a: a.update(scale=torch.tensor(0.5)),
}


@pytest.mark.parametrize("bad", list(_BAD))
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_validation(bad, backend):
    args = _valid_args()
    _BAD[bad](args)
    fn = paged_attention_decode_torch if backend == "torch" else paged_attention_decode_triton
    with pytest.raises(ValueError, match="paged_attention_decode"):
        fn(**args)


def test_reference_rejects_short_block_table():
    args = _valid_args()
    args["seq_lens"] = torch.tensor([1, 17, 2], dtype=torch.int32, device=DEVICE)  # 17 tokens need 3 blocks of 8
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode_torch(**args)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_attention_decode_triton(**_valid_args())


def _assert_rows_match_naive(out, query, k_cache, v_cache, tables, lens, dtype, scale=0.3):
    """Each row of `out` equals naive attention of its query over its own table's first len slots."""
    nb, bs, hkv, d = k_cache.shape
    for s, (table, n) in enumerate(zip(tables, lens)):
        slots = [table[p // bs] * bs + p % bs for p in range(n)]
        k = k_cache.reshape(nb * bs, hkv, d)[slots]
        v = v_cache.reshape(nb * bs, hkv, d)[slots]
        exp = naive_attention(query[s : s + 1], k, v, scale, [n - 1])
        torch.testing.assert_close(out[s : s + 1].double(), exp, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 3])
def test_reference_reads_shared_blocks_once(dtype, g):
    """Sequences sharing prefix blocks (n>1 forks, beams, shared system prompts) take the
    distinct-block path; it must agree with naive attention on each sequence's own K/V."""
    import kernels.paged_attention_decode as mod

    bs, hkv, d, nb = 8, 2, 32, 64
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn((nb, bs, hkv, d), generator=gen).to(dtype)
    v_cache = torch.randn((nb, bs, hkv, d), generator=gen).to(dtype)
    prefix = [5, 9, 2, 40]  # 4 shared blocks = 32 tokens
    tables = [prefix + [11], prefix + [12, 13], prefix + [14], prefix[:3], prefix + [15]]
    lens = [33, 47, 40, 20, 32]  # ends in own block, mid-block, block-aligned, inside the prefix
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn((len(tables), hkv * g, d), generator=gen).to(dtype)
    blocks = bt.long()
    assert mod._decode_shared_blocks(query.view(len(tables), hkv, g, d), k_cache, v_cache, blocks,
                                     seq_lens.long(), bs, 0.3) is not None  # the shared path is taken
    out = paged_attention_decode_torch(query, k_cache, v_cache, bt, seq_lens, 0.3)
    _assert_rows_match_naive(out, query, k_cache, v_cache, tables, lens, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_groups_of_shared_prefixes(dtype):
    """Several groups, each sharing its own prefix (G system prompts x Q questions), plus
    unshared rows: the whole-batch distinct path does not pay, each group's does. Every row must
    agree with naive attention over its own K/V."""
    import kernels.paged_attention_decode as mod

    bs, hkv, g, d, nb = 8, 2, 3, 16, 128
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn((nb, bs, hkv, d), generator=gen).to(dtype)
    v_cache = torch.randn((nb, bs, hkv, d), generator=gen).to(dtype)
    prefixes = [list(range(1, 9)), list(range(20, 28)), list(range(40, 48))]  # 64 tokens each
    tables, lens, own = [], [], iter(range(60, 128))
    for p in prefixes:
        for q_len in (3, 8, 13, 16):  # mid-block, block-aligned, two own blocks
            tables.append(p + [next(own) for _ in range(-(-q_len // bs))])
            lens.append(64 + q_len)
    tables.append(prefixes[0][:5])  # ends inside its group's prefix: the common part shrinks to 4 blocks
    lens.append(37)
    tables += [[next(own) for _ in range(3)], [next(own) for _ in range(2)]]  # unshared rows
    lens += [19, 9]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn((len(tables), hkv * g, d), generator=gen).to(dtype)
    q4, blocks = query.view(len(tables), hkv, g, d), bt.long()
    assert mod._decode_shared_blocks(q4, k_cache, v_cache, blocks, seq_lens.long(), bs, 0.3) is None
    assert mod._decode_by_prefix_group(q4, k_cache, v_cache, blocks, seq_lens.long(), bs, 0.3) is not None
    out = paged_attention_decode_torch(query, k_cache, v_cache, bt, seq_lens, 0.3)
    _assert_rows_match_naive(out, query, k_cache, v_cache, tables, lens, dtype)
