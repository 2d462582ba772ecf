"""Sliding-window and soft-capped attention: every backend's decode and prefill op against a dense
computation written here (all keys gathered, the masks built from positions), including sequences
shorter than the window (the kernels' own path) and cached prefixes (prefill rows late in a sequence)."""
import pytest
import torch
from kernels_testlib import DEVICE, needs_triton

from kernels import get_ops
from kernels.masked_attention import masked_paged_attention_torch

NB, BS, HKV, G, D = 48, 8, 2, 3, 16


def _dense(query, k_cache, v_cache, table, kv_len, q_pos, scale, window, softcap):
    """query [n, Hq, D] at absolute positions q_pos [n] of one sequence -> [n, Hq, D], in float32."""
    pos = torch.arange(kv_len)
    slots = table[pos // BS].long() * BS + pos % BS
    k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(G, 1)  # [K, Hq, D]
    v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(G, 1)
    s = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    visible = pos[None] <= q_pos[:, None]
    if window:
        visible &= q_pos[:, None] - pos[None] < window
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)


def _case(dtype, lens, q_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    v = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(NB, generator=g)[:12] for _ in lens]).int()  # [S, 12]
    q = torch.randn(sum(q_lens), HKV * G, D, generator=g).to(dtype)
    return q, k, v, tables


def _expected(q, k, v, tables, lens, q_lens, scale, window, softcap):
    rows, start = [], 0
    for s, (n, ql) in enumerate(zip(lens, q_lens)):
        rows.append(_dense(q[start:start + ql], k, v, tables[s], n, torch.arange(n - ql, n), scale, window, softcap))
        start += ql
    return torch.cat(rows)


BACKENDS = ["torch", "cpu", pytest.param("triton", marks=needs_triton)]


def _on(backend, *tensors):
    """The tensors on the backend's device: Triton's is the GPU where there is one (else the interpreter's CPU)."""
    device = DEVICE if backend == "triton" else torch.device("cpu")
    return [t.to(device) for t in tensors]
WINDOWS_CAPS = [(0, 0.0), (5, 0.0), (16, 0.0), (0, 7.5), (5, 7.5), (200, 0.0)]  # 200: longer than every sequence


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", WINDOWS_CAPS)
def test_decode_window_softcap(backend, dtype, window, softcap):
    lens = [1, 4, 17, 40, 90]
    q, k, v, tables = _case(dtype, lens, [1] * len(lens))
    ops = get_ops(backend, DEVICE if backend == "triton" else "cpu", dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = ops.paged_attention_decode(*_on(backend, q, k, v, tables, seq_lens), 0.3, window=window, softcap=softcap)
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.float().cpu(), _expected(q, k, v, tables, lens, [1] * len(lens), 0.3, window, softcap),
                               **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", WINDOWS_CAPS)
def test_prefill_window_softcap(backend, dtype, window, softcap):
    lens, q_lens = [30, 7, 90, 41], [30, 3, 25, 1]  # whole prompts, cached prefixes, a one-token chunk
    q, k, v, tables = _case(dtype, lens, q_lens, seed=1)
    ops = get_ops(backend, DEVICE if backend == "triton" else "cpu", dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = ops.paged_attention_prefill(*_on(backend, q, k, v, tables, torch.tensor(lens, dtype=torch.int32), qsl), 0.3,
                                      window=window, softcap=softcap)
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.float().cpu(), _expected(q, k, v, tables, lens, q_lens, 0.3, window, softcap), **tol)


def test_long_prefill_chunks_queries():
    """More query rows than one scoring chunk (256): the window's keys per chunk, the same result."""
    lens, q_lens = [300], [300]
    q, k, v, _ = _case(torch.float32, [1], [300], seed=2)
    tables = torch.randperm(NB)[:38].view(1, 38).int()
    k, v = torch.randn(NB, BS, HKV, D), torch.randn(NB, BS, HKV, D)
    qsl = torch.tensor([0, 300], dtype=torch.int32)
    out = masked_paged_attention_torch(q, k, v, tables, torch.tensor(lens, dtype=torch.int32), qsl, 0.3, 40, 0.0)
    torch.testing.assert_close(out, _expected(q, k, v, tables, lens, q_lens, 0.3, 40, 0.0), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (2.5, 0.0), (True, 0.0), (0, -1.0), (0, float("nan"))])
def test_bad_window_or_softcap_is_refused(window, softcap):
    q, k, v, tables = _case(torch.float32, [4], [1])
    for backend in ("torch", "cpu"):
        ops = get_ops(backend, "cpu", torch.float32)
        with pytest.raises(ValueError, match="window|softcap"):
            ops.paged_attention_prefill(q, k, v, tables, torch.tensor([4], dtype=torch.int32),
                                        torch.tensor([0, 1], dtype=torch.int32), 0.3, window=window, softcap=softcap)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (20, 7.5)])
def test_triton_decode_window_with_split_kv(num_splits, window, softcap):
    """Flash-decoding splits wholly before the window stay empty and merge to the same result."""
    from kernels.paged_attention_decode import _launch

    lens = [1, 17, 40, 90]
    q, k, v, tables = _case(torch.float32, lens, [1] * len(lens), seed=3)
    out = _launch(*_on("triton", q, k, v, tables, torch.tensor(lens, dtype=torch.int32)), 0.3, num_splits=num_splits,
                  block_n=16, window=window, softcap=softcap)
    torch.testing.assert_close(out.cpu(), _expected(q, k, v, tables, lens, [1] * len(lens), 0.3, window, softcap),
                               atol=2e-5, rtol=2e-5)


def test_windowed_decode_checks_the_block_table_width():
    """The checking launchers (the bound C op trusts the model runner's tables, windowed or not)."""
    from kernels import paged_attention_decode_cpu, paged_attention_decode_torch

    q, k, v, tables = _case(torch.float32, [90], [1])
    for op in (paged_attention_decode_torch, paged_attention_decode_cpu):
        with pytest.raises(ValueError, match="columns"):
            op(q, k, v, tables[:, :4], torch.tensor([90], dtype=torch.int32), 0.3, window=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,d,g", [(16, 64, 3), (32, 64, 2), (32, 32, 4), (16, 128, 1)])
@pytest.mark.parametrize("window", [1, 7, 16, 21, 40])
def test_c_decode_reads_only_the_window(dtype, bs, d, g, window):
    """The C decode kernel's own window (its specialised items for SmolLM2's shapes and the generic
    one; blocks of 32 hold tiles wholly before a window) against the dense computation."""
    gen = torch.Generator().manual_seed(window)
    k, v = (torch.randn(40, bs, 2, d, generator=gen).to(dtype) for _ in range(2))
    lens = [1, 5, 21, 33, 64, 100]
    tables = torch.stack([torch.randperm(40, generator=gen)[:8] for _ in lens]).int()
    q = torch.randn(len(lens), 2 * g, d, generator=gen).to(dtype)
    ops = get_ops("cpu", "cpu", dtype)
    out = ops.paged_attention_decode(q, k, v, tables, torch.tensor(lens, dtype=torch.int32), 0.2, window=window)
    expected = []
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        keep = pos[n - window:] if n > window else pos
        slots = tables[i, keep // bs].long() * bs + keep % bs
        kk = k.flatten(0, 1)[slots].float().repeat_interleave(g, 1)  # [K, Hq, D]
        vv = v.flatten(0, 1)[slots].float().repeat_interleave(g, 1)
        s = torch.einsum("hd,khd->hk", q[i].float(), kk) * 0.2
        expected.append(torch.einsum("hk,khd->hd", s.softmax(-1), vv))
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.float(), torch.stack(expected), **tol)
