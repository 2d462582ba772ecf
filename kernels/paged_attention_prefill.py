"""paged_attention_prefill: causal attention of new tokens (prefill / chunked prefill / prefix hits).

    paged_attention_prefill(query[T,Hq,D], k_cache, v_cache, block_tables[S,max_blocks] int32,
                            seq_lens[S] int32, query_start_loc[S+1] int32, scale: float, window=0,
                            softcap=0.0, k_scale=1.0, v_scale=1.0) -> out[T,Hq,D]

Sequence ``s`` owns query rows ``query_start_loc[s] .. query_start_loc[s+1]-1``; these
``q_len`` queries are its LAST ``q_len`` positions (absolute positions
``seq_len - q_len .. seq_len - 1``). The new tokens' K/V must already be in the cache (store_kv
runs first); all K/V is read through the block table. Causal: the query at absolute position
``p`` sees keys ``0 .. p``. Block-table entries past ``seq_len`` are never read. An fp8 cache
(kernels/kv_quant.py) is read as ``float32(stored) * k_scale`` (``v_scale``) in the query's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from . import _common
from ._common import (
    activation_dtype,
    cdiv,
    check_cache_pair,
    check_float,
    check_index,
    check_triton_device,
    interpret_mode,
    lazy_jit,
    next_pow2,
)

from .masked_attention import check_window_softcap, masked_paged_attention_torch, window_or_softcap_applies
from .kv_quant import as_bytes, check_scales, dequantized_blocks, is_fp8
from .online_softmax_triton import bind_into
from .prefill_cpu import prefill_cpu

# triton.language, bound by _common.lazy_jit at the first Triton launch: importing this module never
# imports triton (the kernels' `tl.constexpr` annotations are strings, see `from __future__`).
tl: Any = None
paged_kv_tile: Any = None  # the jitted online-softmax tile (online_softmax_triton.py), bound by bind_into

_OP = "paged_attention_prefill"
_IDX = (torch.int32, torch.int64)


def _validate(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=0, softcap=0.0,
              k_scale=1.0, v_scale=1.0):
    nb, bs, hkv, d = check_cache_pair(_OP, k_cache, v_cache)
    check_window_softcap(_OP, window, softcap)
    if is_fp8(k_cache):
        check_scales(_OP, k_scale, v_scale)
    dev = k_cache.device
    check_float(_OP, "query", query, 3, activation_dtype(k_cache.dtype, query), dev)
    t, hq, dq = query.shape
    if dq != d:
        raise ValueError(f"{_OP}: query head_dim {dq} != cache head_dim {d}")
    if hq == 0 or hq % hkv != 0:
        raise ValueError(f"{_OP}: num query heads {hq} must be a positive multiple of num kv heads {hkv}")
    check_index(_OP, "block_tables", block_tables, 2, _IDX, dev)
    check_index(_OP, "seq_lens", seq_lens, 1, _IDX, dev)
    check_index(_OP, "query_start_loc", query_start_loc, 1, _IDX, dev)
    s = seq_lens.shape[0]
    if block_tables.shape[0] != s:
        raise ValueError(f"{_OP}: block_tables has {block_tables.shape[0]} rows for {s} sequences")
    if query_start_loc.shape[0] != s + 1:
        raise ValueError(f"{_OP}: query_start_loc must have S+1={s + 1} entries, got {query_start_loc.shape[0]}")
    if block_tables.numel() > 0 and block_tables.stride(-1) != 1:
        raise ValueError(f"{_OP}: block_tables last dim must be contiguous, got strides {block_tables.stride()}")
    if query_start_loc.numel() > 0 and query_start_loc.stride(0) != 1:
        raise ValueError(f"{_OP}: query_start_loc must be contiguous")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{_OP}: scale must be a finite float, got {scale!r}")
    return t, hq, d, s, nb, bs, hkv


def check_sequences(query_start_loc, seq_lens, t: int, width: int, bs: int) -> tuple[list[int], list[int]]:
    """query_start_loc and seq_lens as lists, after the per-sequence rules every CPU path checks
    before reading the cache: query rows split 0 .. T in order, and each sequence with queries has
    at most seq_len of them and block-table columns for all its positions."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    s = len(lens)
    if qsl[0] != 0 or qsl[-1] != t or any(qsl[i + 1] < qsl[i] for i in range(s)):
        raise ValueError(f"{_OP}: query_start_loc must be non-decreasing from 0 to T={t}, got {qsl}")
    for i in range(s):
        q_len, kv_len = qsl[i + 1] - qsl[i], lens[i]
        if q_len == 0:
            continue  # not read at all
        if q_len > kv_len:
            raise ValueError(f"{_OP}: sequence {i} has {q_len} queries but seq_len {kv_len}")
        if cdiv(kv_len, bs) > width:
            raise ValueError(
                f"{_OP}: seq_len {kv_len} needs {cdiv(kv_len, bs)} blocks but block_tables has {width} columns"
            )
    return qsl, lens


# --------------------------------------------------------------------------- torch reference


def paged_attention_prefill_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Torch reference (and CPU production path) of :func:`paged_attention_prefill_triton`.

    On CPU: kernels/prefill_cpu.py (flash-attention calls over parts of the keys, merged by their
    log-sum-exps). Elsewhere one SDPA call per sequence on its gathered K/V. GQA without copying KV:
    the query is viewed as ``[Hkv, G, q_len, D]`` and K/V are broadcast (stride 0) over G, which
    measured 1.7-3x faster on CPU than ``enable_gqa=True`` (and faster than repeating KV). An fp8 cache:
    the same over the blocks read, dequantized to the query's dtype (kv_quant.dequantized_blocks).
    """
    t, hq, d, s, nb, bs, hkv = _validate(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                         window, softcap, k_scale, v_scale)
    if is_fp8(k_cache):
        k, v, tables = dequantized_blocks(k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, query.dtype)
        return paged_attention_prefill_torch(query, k, v, tables, seq_lens, query_start_loc, scale, window, softcap)
    out = query.new_empty((t, hq, d))
    if t == 0 or s == 0:
        return out
    if window_or_softcap_applies(seq_lens, window, softcap):
        check_sequences(query_start_loc, seq_lens, t, block_tables.shape[1], bs)
        return masked_paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                            window, softcap)
    g = hq // hkv
    dev = query.device
    qsl, lens = check_sequences(query_start_loc, seq_lens, t, block_tables.shape[1], bs)
    if dev.type == "cpu":  # flash-attention parts merged by log-sum-exp, shared cached prefixes once
        return prefill_cpu(query, k_cache, v_cache, block_tables, qsl, lens, float(scale), out)
    kf = k_cache.flatten(0, 1)  # [NB*BS, Hkv, D], a view for the engine's contiguous caches
    vf = v_cache.flatten(0, 1)
    arange_bs = torch.arange(bs, device=dev)
    scale = float(scale)
    for i in range(s):
        q0, q1 = qsl[i], qsl[i + 1]
        q_len, kv_len = q1 - q0, lens[i]
        if q_len == 0:
            continue
        nblk = cdiv(kv_len, bs)
        slots = (block_tables[i, :nblk].to(torch.int64).unsqueeze(1) * bs + arange_bs).view(-1)[:kv_len]
        k = kf.index_select(0, slots).transpose(0, 1).unsqueeze(1).expand(hkv, g, kv_len, d)
        v = vf.index_select(0, slots).transpose(0, 1).unsqueeze(1).expand(hkv, g, kv_len, d)
        q = query[q0:q1].reshape(q_len, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, q_len, D]
        offset = kv_len - q_len  # queries are the last q_len positions
        if offset == 0:  # no cached prefix: plain causal, lets SDPA skip the upper triangle (~2x)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            mask = torch.arange(kv_len, device=dev).unsqueeze(0) <= (
                torch.arange(q_len, device=dev).unsqueeze(1) + offset
            )
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [Hkv, G, q_len, D]
        out[q0:q1] = o.permute(2, 0, 1, 3).reshape(q_len, hq, d)
    return out


# --------------------------------------------------------------------------- triton kernel


def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (WINDOWED): a query at p sees keys p-window+1 .. p
    softcap_log2,  # soft cap * log2(e) (SOFTCAP)
    k_scale,  # an fp8 cache's (a uint8 k_cache_ptr: e4m3 bits) dequantization scales
    v_scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ot,
    stride_oh,
    queries_per_kv,
    head_dim,
    block_size,
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_G: tl.constexpr,  # query heads per kv head, padded to a power of 2
    BLOCK_M: tl.constexpr,  # BLOCK_Q * BLOCK_G rows: (token, head-in-group) pairs
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per iteration
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # Programs over (query tile, kv head). Query tiles of all sequences are numbered
    # contiguously: sequence s owns tiles qsl[s] // BLOCK_Q + s .. qsl[s+1] // BLOCK_Q + s
    # (an upper bound on cdiv(q_len, BLOCK_Q)); the spare ones exit.
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # binary search: last sequence whose first tile index <= pid
    lo: tl.int32 = 0
    hi = lo + num_seqs  # a tensor even when triton specializes num_seqs == 1 to a constexpr
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        ctx_len = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        tok = tile * BLOCK_Q + offs_m // BLOCK_G
        grp = offs_m % BLOCK_G
        row_mask = (tok < q_len) & (grp < queries_per_kv)
        d_mask = offs_d < head_dim
        q_pos = ctx_len + tok  # absolute position of each row's query
        q_rows = (q_start + tok).to(tl.int64)
        q_heads = kvh * queries_per_kv + grp
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + q_heads[:, None] * stride_qh + offs_d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # keys needed by this tile: up to the last real query's position (causal)
        kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q))
        bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
        k_head = k_cache_ptr + kvh * stride_kh
        v_head = v_cache_ptr + kvh * stride_vh
        kv_start = 0
        if WINDOWED:  # keys before the tile's first query's window are seen by no row of it
            kv_start = tl.maximum(0, ctx_len + tile * BLOCK_Q - window + 1)
        for n0 in range(kv_start, kv_end, BLOCK_N):
            m_i, l_i, acc = paged_kv_tile(q, m_i, l_i, acc, bt_row, k_head, v_head, n0, kv_end, q_pos, offs_d,
                                          d_mask, block_size, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                          window, softcap_log2, k_scale, v_scale, BLOCK_N, True, UPCAST, IEEE,
                                          WINDOWED, SOFTCAP)

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + q_heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


_KERNELS: dict = {}


def _launch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, block_m=None, block_n=None,
            window=0, softcap=0.0, k_scale=1.0, v_scale=1.0):
    t, hq, d, s, nb, bs, hkv = _validate(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                         window, softcap, k_scale, v_scale)
    check_triton_device(_OP, k_cache.device)
    k_cache, v_cache = as_bytes(k_cache), as_bytes(v_cache)  # fp8: the e4m3 bits (the interpreter has no float8)
    out = _common.alloc_output((t, hq, d), query.dtype, query.device)
    if t == 0 or s == 0:
        return out
    g = hq // hkv
    block_g = next_pow2(g)
    block_m = max(16, next_pow2(block_m or 64), block_g)
    block_q = block_m // block_g
    block_d = max(16, next_pow2(d))
    block_n = max(16, next_pow2(block_n or 64))
    num_tiles = t // block_q + s  # upper bound on sum_s cdiv(q_len_s, block_q); no device sync
    upcast = interpret_mode() and query.dtype == torch.bfloat16  # triton-lang/triton#11584
    bind_into(_prefill_kernel)
    kernel = lazy_jit(_KERNELS, _prefill_kernel)
    kernel[(num_tiles, hkv)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        float(scale) * 1.4426950408889634,
        int(window),
        float(softcap) * 1.4426950408889634,
        float(k_scale),
        float(v_scale),
        s,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        g,
        d,
        bs,
        BLOCK_Q=block_q,
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        IEEE=query.dtype == torch.float32 or upcast,
        UPCAST=upcast,
        WINDOWED=window > 0,
        SOFTCAP=softcap > 0,
    )
    return out


def paged_attention_prefill_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal prefill attention over the paged KV cache (Triton). Returns ``[T, Hq, D]``."""
    return _launch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=window,
                   softcap=softcap, k_scale=k_scale, v_scale=v_scale)
