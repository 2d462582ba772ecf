"""paged_attention_decode: one new query token per sequence against its paged KV.

    paged_attention_decode(query[B,Hq,D], k_cache, v_cache, block_tables[B,max_blocks] int32,
                           seq_lens[B] int32, scale: float, window=0, softcap=0.0,
                           k_scale=1.0, v_scale=1.0) -> out[B,Hq,D]

Sequence ``b`` attends to its positions ``0 .. seq_lens[b]-1``; position ``p`` lives in block
``block_tables[b, p // block_size]`` at offset ``p % block_size``. Block-table entries past
``seq_lens[b]`` are never read. ``Hq % Hkv == 0`` (query head ``h`` uses KV head ``h // (Hq//Hkv)``).
A sequence with ``seq_len == 0`` gets a zero output row. An fp8 cache (kernels/kv_quant.py) is read as
``float32(stored) * k_scale`` (``v_scale``) in the query's dtype; a model-dtype cache ignores the scales.
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

from .masked_attention import (
    check_window_softcap,
    decode_as_prefill,
    masked_paged_attention_torch,
    window_or_softcap_applies,
    windowed_decode_torch,
)
from .kv_quant import as_bytes, check_scales, dequantized_blocks, is_fp8
from .online_softmax_triton import bind_into

# triton.language, bound by _common.lazy_jit at the first Triton launch: importing this module never
# imports triton (the kernels' `tl.constexpr` annotations are strings, see `from __future__`).
tl: Any = None
paged_kv_tile: Any = None  # the jitted online-softmax tile (online_softmax_triton.py), bound by bind_into

_OP = "paged_attention_decode"
_IDX = (torch.int32, torch.int64)


def _validate(query, k_cache, v_cache, block_tables, seq_lens, scale, window=0, softcap=0.0, k_scale=1.0,
              v_scale=1.0):
    nb, bs, hkv, d = check_cache_pair(_OP, k_cache, v_cache)
    check_window_softcap(_OP, window, softcap)
    if is_fp8(k_cache):
        check_scales(_OP, k_scale, v_scale)
    dev = k_cache.device
    check_float(_OP, "query", query, 3, activation_dtype(k_cache.dtype, query), dev)
    b, hq, dq = query.shape
    if dq != d:
        raise ValueError(f"{_OP}: query head_dim {dq} != cache head_dim {d}")
    if hq == 0 or hq % hkv != 0:
        raise ValueError(f"{_OP}: num query heads {hq} must be a positive multiple of num kv heads {hkv}")
    check_index(_OP, "block_tables", block_tables, 2, _IDX, dev)
    check_index(_OP, "seq_lens", seq_lens, 1, _IDX, dev)
    if block_tables.shape[0] != b or seq_lens.shape[0] != b:
        raise ValueError(
            f"{_OP}: batch mismatch: query has {b} rows, block_tables {block_tables.shape[0]}, "
            f"seq_lens {seq_lens.shape[0]}"
        )
    if block_tables.numel() > 0 and block_tables.stride(-1) != 1:
        raise ValueError(f"{_OP}: block_tables last dim must be contiguous, got strides {block_tables.stride()}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{_OP}: scale must be a finite float, got {scale!r}")
    return b, hq, d, nb, bs, hkv


# --------------------------------------------------------------------------- torch reference


def paged_attention_decode_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Torch reference (and CPU production path) of :func:`paged_attention_decode_triton`.

    Vectorized over the batch: one padded slot index ``[B, Kmax]`` built from the block tables,
    K/V gathered with index_select into ``[n, Kmax, Hkv, D]`` and one SDPA call with a key-padding
    mask per group of n sequences (n sized so the gathered K+V stay in cache on CPU; the whole
    batch at once elsewhere). GQA without repeating KV: the G query heads of a KV group act as G
    query positions against ``[n, Hkv, Kmax, D]`` keys. Computes in the input dtype.
    On CPU, sequences that share prefix blocks (per group of rows with the same first block) read
    the distinct blocks once instead (:func:`_decode_by_prefix_group`). An fp8 cache: the same over the
    blocks read, dequantized to the query's dtype (kv_quant.dequantized_blocks).
    """
    b, hq, d, nb, bs, hkv = _validate(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                      k_scale, v_scale)
    if is_fp8(k_cache):
        k, v, tables = dequantized_blocks(k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, query.dtype)
        return paged_attention_decode_torch(query, k, v, tables, seq_lens, scale, window, softcap)
    if b == 0:
        return query.new_empty((0, hq, d))
    g = hq // hkv
    dev = query.device
    lens_host = seq_lens.tolist()
    lo, hi = min(lens_host), max(lens_host)
    if hi <= 0:
        return query.new_zeros((b, hq, d))
    nblk = cdiv(hi, bs)
    if nblk > block_tables.shape[1]:
        raise ValueError(
            f"{_OP}: seq_len {hi} needs {nblk} blocks but block_tables has {block_tables.shape[1]} columns"
        )
    if window_or_softcap_applies(seq_lens, window, softcap):
        if softcap == 0:  # a window only: batched over the window's positions
            return windowed_decode_torch(query, k_cache, v_cache, block_tables, seq_lens, float(scale), window)
        return masked_paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens,
                                            decode_as_prefill(seq_lens), scale, window, softcap)
    lens = seq_lens.to(torch.int64)
    blocks = block_tables[:, :nblk].to(torch.int64)
    q = query.reshape(b, hkv, g, d)  # the G heads of a group are G "query positions"
    if dev.type == "cpu" and lo > 0:
        shared = _decode_by_prefix_group(q, k_cache, v_cache, blocks, lens, bs, float(scale))
        if shared is not None:
            return shared.reshape(b, hq, d)
    out = _decode_gather(q, k_cache, v_cache, blocks, lens, bs, float(scale)).reshape(b, hq, d)
    if lo <= 0:
        out = out.masked_fill((lens <= 0)[:, None, None], 0.0)
    return out


# Read each distinct block once when the batch shares at least this much: the per-sequence gather
# copies sum(seq_lens) slots of K and V, the shared path copies the distinct blocks once and pays
# B x distinct-slots score work instead (cheap next to memory traffic up to a few times over).
_SHARED_PATH_MAX_WORK = 4


def _decode_shared_blocks(q, k_cache, v_cache, blocks, lens, bs, scale):
    """Decode attention over the batch's DISTINCT blocks: the n>1 samples, beams and requests
    that share a prompt prefix read its KV once instead of once per sequence (CPU path).

    Every query scores every distinct slot in one matmul; a mask keeps, for each sequence, only
    the slots of its own blocks below its length. Returns None when sharing is too low to pay.

        distinct blocks:  u0 u1 u2 ...        (torch.unique of the used block-table entries)
        slot columns:     [u0*bs .. u0*bs+bs) [u1*bs ..) ...
        seq b keeps column u*bs+o  iff  its table holds u at column j and j*bs+o < len_b
    """
    b, hkv, g, d = q.shape
    nblk = blocks.shape[1]
    used = torch.arange(nblk).unsqueeze(0) * bs < lens.unsqueeze(1)  # [B, nblk]
    unique, inverse = torch.unique(blocks[used], return_inverse=True)  # inverse: per used entry
    slots = unique.numel() * bs
    if b * slots > _SHARED_PATH_MAX_WORK * int(lens.sum()):
        return None
    rows, cols = used.nonzero(as_tuple=True)  # row-major, aligned with `inverse`
    offs = torch.arange(bs)
    visible = (cols.unsqueeze(1) * bs + offs) < lens[rows].unsqueeze(1)  # [n_used, bs]
    columns = inverse.unsqueeze(1) * bs + offs  # [n_used, bs] column in the distinct layout
    mask = torch.zeros(b, slots, dtype=torch.bool)
    mask[rows.unsqueeze(1).expand_as(columns)[visible], columns[visible]] = True  # [B, S]

    k = k_cache.index_select(0, unique).reshape(slots, hkv, d).permute(1, 2, 0)  # [Hkv, D, S]
    v = v_cache.index_select(0, unique).reshape(slots, hkv, d).transpose(0, 1)  # [Hkv, S, D]
    qh = q.permute(1, 0, 2, 3).reshape(hkv, b * g, d)  # [Hkv, B*G, D]
    scores = torch.matmul(qh, k).float() * scale  # [Hkv, B*G, S]
    scores = scores.view(hkv, b, g, slots).masked_fill(~mask[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(hkv, b * g, slots)
    out = torch.matmul(probs, v)  # [Hkv, B*G, D]
    return out.view(hkv, b, g, d).permute(1, 0, 2, 3)  # [B, Hkv, G, D]


def _decode_by_prefix_group(q, k_cache, v_cache, blocks, lens, bs, scale):
    """Cascade attention per group of sequences that start with the same block (one system
    prompt, one document, one forked prompt): the group's common prefix is read and scored once
    for all its queries, each sequence's own tail is gathered, and the two partial softmaxes are
    merged by their log-sum-exp. Rows in no group go through the gather path. Returns None when
    nothing is shared (the caller gathers all rows).

        rows sorted by first block:  [g0 g0 g0 | g1 g1 | s | g2 g2 g2 g2]   (s: a singleton)
        one row of a group:          [ common prefix: c full blocks | own tail: len - c*bs ]
    """
    whole = _decode_shared_blocks(q, k_cache, v_cache, blocks, lens, bs, scale)
    if whole is not None:
        return whole
    heads, group_of, counts = torch.unique(blocks[:, 0], return_inverse=True, return_counts=True)
    if int(counts.max()) < 2:
        return None
    out = q.new_empty(q.shape)  # [B, Hkv, G, D]
    rest: list[torch.Tensor] = []
    for gi in range(heads.numel()):
        rows = (group_of == gi).nonzero(as_tuple=True)[0]
        c = _common_full_blocks(blocks[rows], lens[rows], bs) if rows.numel() >= 2 else 0
        if c == 0:
            rest.append(rows)
        else:
            out[rows] = _decode_cascade(q[rows], k_cache, v_cache, blocks[rows], lens[rows], bs, scale, c)
    if len(rest) == heads.numel():
        return None
    if rest:
        rows = torch.cat(rest)
        out[rows] = _decode_gather(q[rows], k_cache, v_cache, blocks[rows], lens[rows], bs, scale)
    return out


def _common_full_blocks(blocks, lens, bs) -> int:
    """Leading block-table columns equal in every row and full (visible) in every row."""
    limit = min(int(lens.min()) // bs, blocks.shape[1])
    same = (blocks[:, :limit] == blocks[:1, :limit]).all(dim=0)  # [limit]
    return limit if bool(same.all()) else int((~same).nonzero()[0])


def _decode_cascade(q, k_cache, v_cache, blocks, lens, bs, scale, c):
    """q [n, Hkv, G, D] of rows sharing their first c blocks -> [n, Hkv, G, D]."""
    n, hkv, g, d = q.shape
    sp = c * bs
    # prefix: every query of the group against the shared slots, no mask needed.
    kp = k_cache.index_select(0, blocks[0, :c]).reshape(sp, hkv, d).permute(1, 2, 0)  # [Hkv, D, Sp]
    vp = v_cache.index_select(0, blocks[0, :c]).reshape(sp, hkv, d).transpose(0, 1)  # [Hkv, Sp, D]
    qh = q.permute(1, 0, 2, 3).reshape(hkv, n * g, d)  # [Hkv, n*G, D]
    s_p = torch.matmul(qh, kp).float() * scale  # [Hkv, n*G, Sp]
    m_p = s_p.amax(-1, keepdim=True)  # [Hkv, n*G, 1]
    e_p = torch.exp(s_p - m_p)
    l_p = e_p.sum(-1, keepdim=True)
    o_p = torch.matmul(e_p.to(vp.dtype), vp).float()  # [Hkv, n*G, D]
    # tail: each row's own positions [sp, len), padded to the longest tail and masked.
    tails = lens - sp  # [n] >= 0
    ks = int(tails.max())
    if ks == 0:
        out = o_p / l_p
    else:
        j = torch.arange(ks)
        slots = blocks[:, c + j // bs] * bs + j % bs  # [n, Ks]
        valid = j.unsqueeze(0) < tails.unsqueeze(1)  # [n, Ks]
        slots = torch.where(valid, slots, slots[:, :1])
        kt = k_cache.flatten(0, 1).index_select(0, slots.reshape(-1)).view(n, ks, hkv, d)
        vt = v_cache.flatten(0, 1).index_select(0, slots.reshape(-1)).view(n, ks, hkv, d)
        s_t = torch.matmul(q, kt.permute(0, 2, 3, 1)).float() * scale  # [n, Hkv, G, Ks]
        s_t = s_t.masked_fill(~valid[:, None, None, :], float("-inf"))
        m_t = s_t.amax(-1, keepdim=True)  # [n, Hkv, G, 1]; -inf for rows without a tail
        e_t = torch.exp(s_t - torch.where(torch.isinf(m_t), 0.0, m_t))
        l_t = e_t.sum(-1, keepdim=True)
        o_t = torch.matmul(e_t.to(vt.dtype), vt.transpose(1, 2)).float()  # [n, Hkv, G, D]
        # to the prefix layout [Hkv, n*G, *] and merge the two partial softmaxes
        m_t, l_t, o_t = (x.permute(1, 0, 2, 3).reshape(hkv, n * g, -1) for x in (m_t, l_t, o_t))
        m = torch.maximum(m_p, m_t)
        a_p, a_t = torch.exp(m_p - m), torch.exp(m_t - m)
        out = (o_p * a_p + o_t * a_t) / (l_p * a_p + l_t * a_t)
    return out.to(q.dtype).view(hkv, n, g, d).permute(1, 0, 2, 3)


def _decode_gather(q, k_cache, v_cache, blocks, lens, bs, scale):
    """The general path: gather each sequence's K/V slots and run SDPA with a key-padding mask.
    q [n, Hkv, G, D]; rows with lens <= 0 read a real slot and must be zeroed by the caller."""
    lens_host = lens.tolist()
    hi = max(1, max(lens_host))
    n, hkv, _, d = q.shape
    dev = q.device
    nblk = cdiv(hi, bs)
    slots = (blocks[:, :nblk].unsqueeze(-1) * bs + torch.arange(bs, device=dev)).view(n, nblk * bs)[:, :hi]
    valid = torch.arange(hi, device=dev).unsqueeze(0) < lens.unsqueeze(1)  # [n, Kmax]
    empty = lens <= 0  # empty rows: read any real slot (the caller zeroes their output)
    valid[:, 0] |= empty
    slots[:, 0] = torch.where(empty, 0, slots[:, 0])
    # padding positions read the sequence's own first slot: real (finite) data, masked out.
    slots = torch.where(valid, slots, slots[:, :1])
    kf = k_cache.flatten(0, 1)  # [NB*BS, Hkv, D]: a view for the engine's contiguous caches
    vf = v_cache.flatten(0, 1)
    # Process the batch in chunks whose gathered K+V stay cache-resident (~1.5 MB): measured 2-3x
    # faster on CPU than gathering the whole batch at once (which streams it through DRAM twice).
    per_seq = hi * hkv * d * q.element_size() * 2
    chunk = n if dev.type != "cpu" else max(1, min(n, _CPU_CHUNK_BYTES // max(per_seq, 1)))
    if chunk >= n:
        return _decode_chunk(q, kf, vf, slots, valid, hi, scale)
    out = q.new_empty(q.shape)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        kmax = max(1, max(lens_host[c0:c1]))  # pad only to this chunk's longest sequence
        out[c0:c1] = _decode_chunk(q[c0:c1], kf, vf, slots[c0:c1, :kmax], valid[c0:c1, :kmax], kmax, scale)
    return out


_CPU_CHUNK_BYTES = 3 << 19  # 1.5 MiB of gathered K+V per SDPA call on CPU


def _decode_chunk(q, kf, vf, slots, valid, kmax, scale):
    n, hkv, _, d = q.shape
    idx = slots.reshape(-1)
    k = kf.index_select(0, idx).view(n, kmax, hkv, d).transpose(1, 2)  # [n, Hkv, Kmax, D]
    v = vf.index_select(0, idx).view(n, kmax, hkv, d).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)


# --------------------------------------------------------------------------- triton kernels


def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (WINDOWED): the query sees its last `window` positions
    softcap_log2,  # soft cap * log2(e) (SOFTCAP)
    k_scale,  # an fp8 cache's (a uint8 k_cache_ptr: e4m3 bits) dequantization scales
    v_scale,
    tokens_per_split,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    num_kv_heads,
    queries_per_kv,
    head_dim,
    block_size,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # one program per (sequence, kv head, kv split); all G query heads of the group together
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)
    if WINDOWED:  # skip the keys before the window (a split wholly before it stays empty)
        start = tl.maximum(start, seq_len - window)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < queries_per_kv
    d_mask = offs_d < head_dim
    q_heads = kvh * queries_per_kv + offs_g
    q = tl.load(
        q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq * stride_btb
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh

    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = paged_kv_tile(q, m_i, l_i, acc, bt_row, k_head, v_head, n0, end, seq_len - 1, offs_d, d_mask,
                                      block_size, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window,
                                      softcap_log2, k_scale, v_scale, BLOCK_N, False, UPCAST, IEEE, WINDOWED, SOFTCAP)

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # partial results, laid out [B, Hkv, NUM_SPLITS, BLOCK_G(, BLOCK_D)] contiguous
        row = (seq * num_kv_heads + kvh) * NUM_SPLITS + split
        tl.store(part_m_ptr + row * BLOCK_G + offs_g, m_i)
        tl.store(part_l_ptr + row * BLOCK_G + offs_g, l_i)
        tl.store(part_acc_ptr + (row * BLOCK_G + offs_g[:, None]) * BLOCK_D + offs_d[None, :], acc)

def _decode_reduce_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_kv_heads,
    queries_per_kv,
    head_dim,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    base = (seq * num_kv_heads + kvh) * NUM_SPLITS

    m_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    for sp in range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + (base + sp) * BLOCK_G + offs_g))
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)

    l_tot = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for sp in range(NUM_SPLITS):
        row = base + sp
        w = tl.exp2(tl.load(part_m_ptr + row * BLOCK_G + offs_g) - m_ref)  # 0 for empty splits
        l_tot += w * tl.load(part_l_ptr + row * BLOCK_G + offs_g)
        acc += w[:, None] * tl.load(part_acc_ptr + (row * BLOCK_G + offs_g[:, None]) * BLOCK_D + offs_d[None, :])

    l_safe = tl.where(l_tot > 0.0, l_tot, 1.0)
    out = acc / l_safe[:, None]
    q_heads = kvh * queries_per_kv + offs_g
    mask = (offs_g < queries_per_kv)[:, None] & (offs_d < head_dim)[None, :]
    tl.store(
        out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


_KERNELS: dict = {}
_REDUCE_KERNELS: dict = {}
_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _default_num_splits(b: int, hkv: int, max_ctx: int, device: torch.device) -> int:
    """Split the KV of each sequence (flash-decoding) only when the grid would underfill the GPU."""
    if device.type != "cuda":
        return 1
    programs = b * hkv
    target = 2 * _sm_count(device)
    if programs >= target or max_ctx < 1024:
        return 1
    return max(1, min(cdiv(target, programs), max_ctx // 512, 32))


def _launch(query, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=None, block_n=None, window=0,
            softcap=0.0, k_scale=1.0, v_scale=1.0):
    b, hq, d, nb, bs, hkv = _validate(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                      k_scale, v_scale)
    check_triton_device(_OP, k_cache.device)
    k_cache, v_cache = as_bytes(k_cache), as_bytes(v_cache)  # fp8: the e4m3 bits (the interpreter has no float8)
    out = _common.alloc_output((b, hq, d), query.dtype, query.device)
    if b == 0:
        return out
    g = hq // hkv
    block_g = max(16, next_pow2(g))
    block_d = max(16, next_pow2(d))
    block_n = int(block_n) if block_n else 64
    max_ctx = block_tables.shape[1] * bs  # upper bound on seq_len without a device sync
    if num_splits is None:
        num_splits = _default_num_splits(b, hkv, max_ctx, query.device)
    num_splits = max(1, int(num_splits))
    tokens_per_split = cdiv(cdiv(max(max_ctx, 1), num_splits), block_n) * block_n
    if num_splits > 1:
        part_m = torch.empty((b, hkv, num_splits, block_g), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((b, hkv, num_splits, block_g, block_d), dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused
    # The interpreter cannot tl.dot bfloat16 (triton-lang/triton#11584): compute in fp32 there.
    upcast = interpret_mode() and query.dtype == torch.bfloat16
    bind_into(_decode_kernel)
    kernel = lazy_jit(_KERNELS, _decode_kernel)
    kernel[(b, hkv, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        float(scale) * 1.4426950408889634,
        int(window),
        float(softcap) * 1.4426950408889634,
        float(k_scale),
        float(v_scale),
        tokens_per_split,
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
        hkv,
        g,
        d,
        bs,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        IEEE=query.dtype == torch.float32 or upcast,
        UPCAST=upcast,
        WINDOWED=window > 0,
        SOFTCAP=softcap > 0,
    )
    if num_splits > 1:
        reduce = lazy_jit(_REDUCE_KERNELS, _decode_reduce_kernel)
        reduce[(b, hkv)](
            part_m,
            part_l,
            part_acc,
            out,
            out.stride(0),
            out.stride(1),
            hkv,
            g,
            d,
            BLOCK_G=block_g,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
        )
    return out


def paged_attention_decode_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention over the paged KV cache (Triton). Returns ``[B, Hq, D]`` in query's dtype."""
    return _launch(query, k_cache, v_cache, block_tables, seq_lens, scale, window=window, softcap=softcap,
                   k_scale=k_scale, v_scale=v_scale)
