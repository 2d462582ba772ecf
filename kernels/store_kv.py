"""store_kv: write the new tokens' keys and values into the paged KV cache.

    store_kv(key[T,Hkv,D], value[T,Hkv,D], k_cache, v_cache, slot_mapping[T] int64,
             k_scale=1.0, v_scale=1.0) -> None

``k_cache``/``v_cache`` are ``[num_blocks, block_size, Hkv, D]`` (``kv_cache[layer, 0|1]``);
token ``t`` goes to flat slot ``slot_mapping[t]`` (= block_id * block_size + offset).
Tokens whose slot is negative are skipped (padding). An fp8 cache (kernels/kv_quant.py) stores
``e4m3(clamp(key / k_scale, -448, 448))`` (and the values with ``v_scale``); a model-dtype cache
ignores the scales.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import (activation_dtype, cdiv, check_cache_pair, check_float, check_index, check_triton_device, lazy_jit,
                      next_pow2)
from .kv_quant import check_scales, is_fp8, quantize

# triton.language, bound by _common.lazy_jit at the first Triton launch: importing this module never
# imports triton (the kernels' `tl.constexpr` annotations are strings, see `from __future__`).
tl: Any = None
e4m3_bits: Any = None  # the jitted _e4m3_bits, bound at the first launch (like tl)

_OP = "store_kv"


def _validate(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> tuple[int, int, int, int, int]:
    nb, bs, hkv, d = check_cache_pair(_OP, k_cache, v_cache)
    dev, dtype = k_cache.device, activation_dtype(k_cache.dtype, key)
    if is_fp8(k_cache):
        check_scales(_OP, k_scale, v_scale)
    check_float(_OP, "key", key, 3, dtype, dev)
    check_float(_OP, "value", value, 3, dtype, dev)
    t = key.shape[0]
    if tuple(key.shape) != (t, hkv, d):
        raise ValueError(f"{_OP}: key shape {tuple(key.shape)} must be [T, {hkv}, {d}] to match the cache")
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"{_OP}: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    check_index(_OP, "slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), dev)
    if slot_mapping.shape[0] != t:
        raise ValueError(f"{_OP}: slot_mapping has {slot_mapping.shape[0]} entries for {t} tokens")
    return t, nb, bs, hkv, d


# --------------------------------------------------------------------------- torch reference


def _flat(cache: torch.Tensor) -> torch.Tensor | None:
    """[NB, BS, H, D] -> [NB*BS, H, D] view sharing storage, or None when not viewable."""
    nb, bs, h, d = cache.shape
    try:
        return cache.view(nb * bs, h, d)
    except RuntimeError:
        return None


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Torch reference (and CPU production path) of :func:`store_kv_triton`."""
    t, nb, bs, _, _ = _validate(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if t == 0:
        return
    if is_fp8(k_cache):  # quantized, then moved as bytes (index_copy_ has no float8 on CPU)
        key, value = quantize(key, k_scale).view(torch.uint8), quantize(value, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
    kf, vf = _flat(k_cache), _flat(v_cache)
    if kf is not None and vf is not None:
        kf.index_copy_(0, slots, key)
        vf.index_copy_(0, slots, value)
    else:  # exotic strides: index by (block, offset)
        blk, off = slots // bs, slots % bs
        k_cache[blk, off] = key
        v_cache[blk, off] = value


# --------------------------------------------------------------------------- triton kernel


def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_heads,
    head_dim,
    block_size,
    k_scale,
    v_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per (token, tile of BLOCK_H heads); a uint8 cache holds fp8 e4m3 bits (kernels/kv_quant.py)
    tok = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_heads) & (d < head_dim)
        k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
        if k_cache_ptr.dtype.element_ty == tl.uint8:  # decided at compile time: the model-dtype kernel is unchanged
            k = e4m3_bits(k.to(tl.float32) / k_scale)
            v = e4m3_bits(v.to(tl.float32) / v_scale)
        tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d, k, mask=mask)
        tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, v, mask=mask)


def _e4m3_bits(x):
    """float32 -> e4m3 bits (uint8) of clamp(x, -448, 448), rounded to nearest even exactly as torch converts
    (c10's fp8e4m3fn_from_fp32_value). In integer arithmetic rather than ``x.to(tl.float8e4nv)``: the
    interpreter's float8 rounding differs from torch's (it rounds half up and can carry into the exponent
    wrongly), and one code path serves the interpreter and CUDA alike."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)  # FP8_MAX (a jitted function reads no Python globals)
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # below 2^-6 (e4m3's smallest normal): add 2^14 so the float add rounds the subnormal's 3 bits in place
    sub = ((tl.abs(x) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)) & 0xFF
    # normal: rebias the exponent (127 -> 7), round the 20 dropped mantissa bits to nearest even
    odd = (mag >> 20) & 1
    norm = ((mag - (120 << 23) + 0x7FFFF + odd) >> 20) & 0xFF  # wraps below 2^-6, where `sub` is taken
    return (tl.where(mag < (121 << 23), sub, norm) | sign).to(tl.uint8)


_HELPERS: dict = {}


_KERNELS: dict = {}


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, Hkv, D] into k_cache/v_cache at ``slot_mapping`` (slot < 0: skip); an fp8 cache
    gets them quantized with ``k_scale`` / ``v_scale``."""
    t, nb, bs, hkv, d = _validate(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_triton_device(_OP, k_cache.device)
    if t == 0:
        return
    if is_fp8(k_cache):  # the kernel writes the e4m3 bits (the interpreter has no float8 tensors)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kv_kernel.__globals__["e4m3_bits"] = lazy_jit(_HELPERS, _e4m3_bits)
    kernel = lazy_jit(_KERNELS, _store_kv_kernel)
    block_d = next_pow2(d)
    block_h = min(next_pow2(hkv), max(1, 4096 // block_d))
    grid = (t, cdiv(hkv, block_h))
    kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        hkv,
        d,
        bs,
        float(k_scale),
        float(v_scale),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
