"""The fp8 KV cache (vLLM's ``kv_cache_dtype="fp8"``): K and V stored as float8 e4m3 with per-tensor scales.

    store_kv:   stored = e4m3(clamp(x / k_scale, -448, 448))       (round to nearest even, as torch converts)
    attention:  k      = float32(stored) * k_scale                  (then the attention math of the model dtype)

One byte per element: the same memory holds twice the blocks of a bfloat16 pool and four times those of a
float32 one. ``k_scale`` / ``v_scale`` are one float per layer (vLLM's per-tensor scales), 1.0 where the
checkpoint has none, which is vLLM's default without calibration and ours always. The ops take them as
keyword arguments (``k_scale=1.0, v_scale=1.0``) and ignore them for a model-dtype pool.

The pool is a ``torch.float8_e4m3fn`` tensor. Where bytes move (the Triton kernels, the C kernels, tier
copies) it is viewed as ``torch.uint8``: the Triton interpreter, numpy and some torch CPU ops
(``index_copy_``) have no float8.

The torch references attend over a dequantized copy of the blocks a call reads (:func:`dequantized_blocks`),
which is the definition the kernels are tested against: fp8 attention = model-dtype attention on
``float32(stored) * scale`` rounded to the model dtype.
"""
from __future__ import annotations

import math

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value; anything beyond is clamped to it on store
# EngineConfig.kv_cache_dtype -> the pool's dtype (None: the model dtype), vLLM's spelling
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's torch dtype for a config value (``auto``: the model dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_E4M3


def check_scales(op: str, k_scale, v_scale) -> None:
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"{op}: {name} must be a positive finite float, got {s!r}")


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> e4m3 of clamp(x / scale, -448, 448), in float32 before the rounding."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_E4M3)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 -> float32 * scale -> dtype."""
    return (x.float() * scale).to(dtype)


def dequantized_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, k_scale: float, v_scale: float, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks a call reads, dequantized into a compact cache of the model dtype, and the block tables
    renumbered into it: (k [U, BS, Hkv, D], v, tables [B, W] int32) for U distinct blocks covering
    ``seq_lens``. Entries past a sequence's length (padding) point at block 0 of the copy, never read."""
    bs = k_cache.shape[1]
    width = block_tables.shape[1]
    nblk = (seq_lens.to(torch.int64) + bs - 1) // bs  # [B] blocks each sequence reads
    used = torch.arange(width, device=block_tables.device)[None, :] < nblk[:, None]  # [B, W]
    ids = block_tables.to(torch.int64)
    distinct = torch.unique(ids[used])  # sorted
    if distinct.numel() == 0:  # nothing is read: one block keeps the shapes valid
        distinct = torch.zeros(1, dtype=torch.int64, device=ids.device)
    tables = torch.where(used, torch.searchsorted(distinct, ids.clamp(min=0)), 0).to(torch.int32)
    k = dequantize(k_cache.index_select(0, distinct), k_scale, dtype)
    v = dequantize(v_cache.index_select(0, distinct), v_scale, dtype)
    return k, v, tables


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as its bytes (uint8, same shape); any other tensor as it is."""
    return t.view(torch.uint8) if is_fp8(t) else t


def kv_cache_ops(ops, kv_dtype: torch.dtype, model_dtype: torch.dtype):
    """The op set for a KV pool of ``kv_dtype``: ``ops`` itself for a model-dtype pool (nothing changes); for
    fp8 on the "cpu" set, its KV ops bound for the fp8 pool (kernels/cpu/fp8_kv.py). The torch and Triton ops
    take either pool (the kernel for an fp8 one is chosen by the pool's dtype)."""
    if kv_dtype != FP8_E4M3 or ops.name != "cpu":
        return ops
    from .cpu.fp8_kv import fp8_cpu_ops

    return fp8_cpu_ops(ops, model_dtype)
