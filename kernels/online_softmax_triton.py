"""The online-softmax step over one tile of paged KV, shared by the Triton decode and prefill kernels.

    s = scale * q k^T  (masked: past the sequence, and in prefill past each query's position)
    m' = max(m, rowmax s);  a = 2^(m - m');  p = 2^(s - m')
    l' = a l + rowsum p;    acc' = a acc + p v

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
                  stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # q: [ROWS, BLOCK_D]; m_i, l_i: [ROWS]; acc: [ROWS, BLOCK_D]; positions n0 .. n0 + BLOCK_N - 1
    pos = n0 + tl.arange(0, BLOCK_N)
    p_mask = pos < kv_end
    blk = tl.load(bt_row + pos // block_size, mask=p_mask, other=0).to(tl.int64)
    off = (pos % block_size).to(tl.int64)
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(k_head + blk[:, None] * stride_kb + off[:, None] * stride_ks + offs_d[None, :], mask=kv_mask,
                other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if CAUSAL:
        visible = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
    else:
        visible = p_mask[None, :]
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vs + offs_d[None, :], mask=kv_mask,
                other=0.0)
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
