"""The online-softmax step over one tile of paged KV, shared by the Triton decode and prefill kernels.

    s = scale * q k^T  (masked: past the sequence, and in prefill past each query's position;
                        WINDOWED: keys more than window-1 before the query; SOFTCAP: s = c tanh(s / c))
    m' = max(m, rowmax s);  a = 2^(m - m');  p = 2^(s - m')
    l' = a l + rowsum p;    acc' = a acc + p v

With a window a row may see no key of a tile (its window starts past it): m' stays -inf there and
the exponents are taken against 0 instead, so a = p = 0 rather than NaN. Without one every row sees
key 0 in its first tile, so the guard is compiled in only for WINDOWED.

An fp8 cache arrives as its e4m3 bits (uint8 pointers): each K / V tile is widened to float32, scaled
(k_scale, v_scale) and cast to the query's dtype before the products, so the dots run as for a model-dtype
cache (tensor cores in bfloat16 / float16). Which kind of cache a kernel reads is known when it compiles.

Scores are in log2 units (qk_scale = softmax scale * log2 e), so exp2 replaces exp. Like the
kernels, the function refers to a module global ``tl`` bound at the first launch (see
_common.lazy_jit): importing this module never imports triton.
"""
from __future__ import annotations

from typing import Any

from ._common import lazy_jit

tl: Any = None

_JITTED: dict = {}


def paged_kv_tile(q, m_i, l_i, acc, bt_row, k_head, v_head, n0, kv_end, q_pos, offs_d, d_mask, block_size,
                  stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window, softcap_log2, k_scale, v_scale,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                  WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    # q: [ROWS, BLOCK_D]; m_i, l_i: [ROWS]; acc: [ROWS, BLOCK_D]; positions n0 .. n0 + BLOCK_N - 1
    # q_pos: each row's position [ROWS] (CAUSAL), else the one query's position (decode; WINDOWED only)
    # softcap_log2 = softcap * log2(e), in the units of s * qk_scale
    pos = n0 + tl.arange(0, BLOCK_N)
    p_mask = pos < kv_end
    blk = tl.load(bt_row + pos // block_size, mask=p_mask, other=0).to(tl.int64)
    off = (pos % block_size).to(tl.int64)
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(k_head + blk[:, None] * stride_kb + off[:, None] * stride_ks + offs_d[None, :], mask=kv_mask,
                other=0.0)
    if k_head.dtype.element_ty == tl.uint8:  # fp8 e4m3 bits: float32 * scale, then the query's dtype
        k = (k.to(tl.float8e4nv, bitcast=True).to(tl.float32) * k_scale).to(q.dtype)
    if UPCAST:
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if CAUSAL:
        visible = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            visible = visible & (q_pos[:, None] - pos[None, :] < window)
    else:
        in_window = p_mask
        if WINDOWED:
            in_window = in_window & (q_pos - pos < window)
        visible = in_window[None, :]
    s = s * qk_scale
    if SOFTCAP:  # c tanh(s / c), tanh(x) = 2 sigmoid(2x) - 1 (tl has no tanh)
        s = softcap_log2 * (2.0 * tl.sigmoid(2.0 * s / softcap_log2) - 1.0)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if WINDOWED:  # only a window leaves a row with no visible key yet: exponents against 0, no NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs + offs_d[None, :], mask=kv_mask,
                other=0.0)
    if v_head.dtype.element_ty == tl.uint8:
        v = (v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * v_scale).to(q.dtype)
    if UPCAST:
        v = v.to(tl.float32)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


def bind_into(kernel_fn) -> None:
    """Make the jitted helper visible to a kernel about to be jitted (call before lazy_jit)."""
    kernel_fn.__globals__["paged_kv_tile"] = lazy_jit(_JITTED, paged_kv_tile)
