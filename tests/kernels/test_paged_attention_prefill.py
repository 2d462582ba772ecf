import pytest
import torch
from kernels_testlib import DEVICE, HAS_TRITON, TOL, PagedKV, config_grid, naive_attention, needs_triton, poison_outputs

from kernels.cpu.paged_attention import paged_attention_prefill_cpu
from kernels.paged_attention_prefill import _launch, paged_attention_prefill_torch, paged_attention_prefill_triton

HKV = 2
# Every implementation of the op, for the tests all of them must pass (the C kernel runs on CPU only).
_FN = {"torch": paged_attention_prefill_torch, "triton": paged_attention_prefill_triton,
       "cpu": paged_attention_prefill_cpu}
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton),
            pytest.param("cpu", marks=pytest.mark.skipif(DEVICE.type != "cpu", reason="C kernel: CPU only"))]


def _shapes(bs):
    """(q_len, seq_len) per sequence: fresh prompts, cached prefixes, chunks, 1-token, empty."""
    return [
        (1, 1),  # one-token prompt
        (bs + 3, bs + 3),  # whole prompt, not a multiple of the block size
        (5, 2 * bs + 3),  # prefix hit: 2*bs-2 cached tokens, 5 new
        (0, 4),  # a sequence with no new tokens this step
        (bs, 3 * bs),  # chunk aligned to blocks after a cached prefix
        (1, bs + 1),  # last prompt token recomputed after a full-prefix hit
    ]


def _case(g, d, bs, dtype, seed=0, num_layers=1, shapes=None, hkv=HKV):
    shapes = shapes or _shapes(bs)
    kv = PagedKV([n for _, n in shapes], hkv, d, bs, dtype, seed=seed, num_layers=num_layers)
    q_lens = [q for q, _ in shapes]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    gen = torch.Generator().manual_seed(seed + 100)
    query = torch.randn((qsl[-1], hkv * g, d), generator=gen).to(dtype).to(DEVICE)
    query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
    return kv, query, query_start_loc, d**-0.5


def _naive_prefill(kv, query, query_start_loc, scale, layer=0):
    qsl = query_start_loc.tolist()
    out = torch.empty(query.shape, dtype=torch.float64)
    for s, n in enumerate(kv.seq_lens):
        q0, q1 = qsl[s], qsl[s + 1]
        if q1 == q0:
            continue
        positions = list(range(n - (q1 - q0), n))
        out[q0:q1] = naive_attention(query[q0:q1], kv.k[s][layer], kv.v[s][layer], scale, positions)
    return out


@pytest.mark.parametrize("g,d,bs,dtype", config_grid())
def test_reference_matches_naive(g, d, bs, dtype):
    kv, query, qsl, scale = _case(g, d, bs, dtype)
    k_cache, v_cache = kv.caches()
    out = paged_attention_prefill_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, scale)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), _naive_prefill(kv, query, qsl, scale), **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("g,d,bs,dtype", config_grid())
def test_triton_matches_reference(g, d, bs, dtype, monkeypatch):
    poison_outputs(monkeypatch)
    kv, query, qsl, scale = _case(g, d, bs, dtype, seed=1)
    k_cache, v_cache = kv.caches()
    ref = paged_attention_prefill_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, scale)
    out = paged_attention_prefill_triton(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("hkv,g", [(1, 8), (3, 3)], ids=["MQA-1x8", "Hkv3-G3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mqa_and_odd_kv_heads(hkv, g, dtype, monkeypatch):
    """One KV head for all query heads (MQA), and a non power-of-2 KV head count (SmolLM2: 9/3)."""
    poison_outputs(monkeypatch)
    kv, query, qsl, scale = _case(g, 64, 16, dtype, seed=6, hkv=hkv)
    k_cache, v_cache = kv.caches()
    ref = paged_attention_prefill_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, scale)
    torch.testing.assert_close(ref.cpu().double(), _naive_prefill(kv, query, qsl, scale), **TOL[dtype])
    if HAS_TRITON:
        out = paged_attention_prefill_triton(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, scale)
        torch.testing.assert_close(out, ref, **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_small_tiles(g, dtype, monkeypatch):
    """Several query tiles per sequence and several key tiles per program."""
    poison_outputs(monkeypatch)
    shapes = [(40, 40), (3, 50), (21, 37), (0, 1), (1, 1)]
    kv, query, qsl, scale = _case(g, 32, 8, dtype, seed=2, shapes=shapes)
    k_cache, v_cache = kv.caches()
    ref = paged_attention_prefill_torch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, scale)
    out = _launch(query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, scale, block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_view_and_strided_query(backend, monkeypatch):
    poison_outputs(monkeypatch)
    g, d, bs = 2, 32, 8
    kv, _, qsl, _ = _case(g, d, bs, torch.float32, seed=3, num_layers=2, shapes=[(6, 6), (4, 13)])
    qkv = torch.randn((10, HKV * g + 2 * HKV, d), device=DEVICE)
    query = qkv[:, : HKV * g]
    k_cache, v_cache = kv.caches(layer=1)
    out = _FN[backend](query, k_cache, v_cache, kv.block_tables, kv.seq_lens_t, qsl, 0.2)
    expected = _naive_prefill(kv, query, qsl, 0.2, layer=1)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


def _valid_args():
    kv = torch.zeros((2, 6, 8, 2, 16), device=DEVICE)
    return dict(query=torch.randn((5, 4, 16), device=DEVICE), k_cache=kv[0], v_cache=kv[1],
                block_tables=torch.zeros((2, 2), dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([2, 3], dtype=torch.int32, device=DEVICE),
                query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE), scale=0.25)


_BAD = {
    "query_ndim": lambda a: a.update(query=a["query"][0]),
    "query_dtype": lambda a: a.update(query=a["query"].bfloat16()),
    "head_ratio": lambda a: a.update(query=torch.randn((5, 5, 16), device=DEVICE)),
    "head_dim": lambda a: a.update(query=torch.randn((5, 4, 32), device=DEVICE)),
    "query_last_dim_strided": lambda a: a.update(query=torch.randn((5, 4, 32), device=DEVICE)[..., ::2]),
    "cache_dtype": lambda a: a.update(k_cache=a["k_cache"].half(), v_cache=a["v_cache"].half()),
    "block_tables_rows": lambda a: a.update(block_tables=a["block_tables"][:1]),
    "block_tables_float": lambda a: a.update(block_tables=a["block_tables"].float()),
    "seq_lens_rows": lambda a: a.update(seq_lens=a["seq_lens"][:1]),
    "qsl_len": lambda a: a.update(query_start_loc=a["query_start_loc"][:2]),
    "qsl_dtype": lambda a: a.update(query_start_loc=a["query_start_loc"].float()),
    "qsl_strided": lambda a: a.update(
        query_start_loc=torch.tensor([0, 9, 2, 9, 5, 9], dtype=torch.int32, device=DEVICE)[::2]),
    "scale_none": lambda a: a.update(scale=None),
}


@pytest.mark.parametrize("bad", list(_BAD))
@pytest.mark.parametrize("backend", BACKENDS)
def test_validation(bad, backend):
    args = _valid_args()
    _BAD[bad](args)
    with pytest.raises(ValueError, match="paged_attention_prefill"):
        _FN[backend](**args)


@pytest.mark.parametrize(
    "change",
    [
        dict(query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32)),  # does not end at T
        dict(query_start_loc=torch.tensor([0, 3, 2], dtype=torch.int32)),  # decreasing
        dict(seq_lens=torch.tensor([1, 3], dtype=torch.int32)),  # q_len 2 > seq_len 1
        dict(seq_lens=torch.tensor([2, 17], dtype=torch.int32)),  # needs 3 blocks, table has 2
    ],
)
@pytest.mark.parametrize("backend", ["torch", BACKENDS[2]])
def test_cpu_paths_reject_inconsistent_metadata(change, backend):
    args = _valid_args()
    args.update({k: v.to(DEVICE) for k, v in change.items()})
    with pytest.raises(ValueError, match="paged_attention_prefill"):
        _FN[backend](**args)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_attention_prefill_triton(**_valid_args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequences_sharing_a_cached_prefix_attend_it_together_on_cpu(dtype):
    """Several sequences whose tables start with the same >= 16 cached blocks (one system prompt):
    the CPU path attends that prefix once for the group (kernels/prefill_cpu.py), then each one's
    own cached tokens and its new ones, merged by log-sum-exp -- the same as naive attention."""
    from kernels import prefill_cpu

    bs, hkv, g, d, shared = 8, 3, 3, 64, 18  # 18 shared blocks: a group (>= MIN_SHARED_BLOCKS)
    assert shared >= prefill_cpu.MIN_SHARED_BLOCKS
    gen = torch.Generator().manual_seed(5)
    nb = 200
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    prefix = list(range(10, 10 + shared))
    # (own cached tokens after the prefix, new tokens); the last sequence shares only 5 blocks
    shapes = [(0, 7), (13, 1), (21, 16), (3, 9)]
    tables, lens, next_block = [], [], 100
    for own, new in shapes:
        n = shared * bs + own + new
        width = -(-n // bs)
        tables.append(prefix + list(range(next_block, next_block + width - shared)))
        next_block += width - shared
        lens.append(n)
    tables.append(prefix[:5] + list(range(next_block, next_block + 20)))
    lens.append(5 * bs + 30)
    shapes.append((None, 12))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [new for _, new in shapes]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), hkv * g, d, generator=gen).to(dtype)
    groups = prefill_cpu._shared_prefixes(block_tables.long(), qsl.tolist(), lens, bs)
    assert [(m, c) for m, c in groups] == [([0, 1, 2, 3], shared)]

    out = paged_attention_prefill_torch(query, k_cache, v_cache, block_tables, torch.tensor(lens), qsl, d ** -0.5)
    for i, (n, q_len) in enumerate(zip(lens, q_lens)):
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        k = k_cache.flatten(0, 1)[slots].double()  # [n, Hkv, D]
        v = v_cache.flatten(0, 1)[slots].double()
        q = query[int(qsl[i]):int(qsl[i + 1])].double().view(q_len, hkv, g, d)
        s = torch.einsum("qhgd,khd->hgqk", q, k) * d ** -0.5
        visible = torch.arange(n)[None, :] <= (torch.arange(q_len)[:, None] + n - q_len)
        p = s.masked_fill(~visible, float("-inf")).softmax(-1)
        expected = torch.einsum("hgqk,khd->qhgd", p, v).reshape(q_len, hkv * g, d)
        torch.testing.assert_close(out[int(qsl[i]):int(qsl[i + 1])].double(), expected, **TOL[dtype])
