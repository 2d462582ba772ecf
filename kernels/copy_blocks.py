"""copy_blocks: copy whole KV blocks (copy-on-write), in every layer, K and V.

    copy_blocks(kv_cache[L,2,NB,BS,Hkv,D], block_mapping[N,2] int64 (src, dst)) -> None

For each row ``(src, dst)``: ``kv_cache[:, :, dst] = kv_cache[:, :, src]``. Rows may come in any
order; a dst never aliases a src of the same call (and dsts are distinct). An fp8 pool
(kernels/kv_quant.py) is copied as its bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import CACHE_DTYPES, check_index, check_triton_device, lazy_jit, next_pow2
from .kv_quant import as_bytes

# triton.language, bound by _common.lazy_jit at the first Triton launch: importing this module never
# imports triton (the kernels' `tl.constexpr` annotations are strings, see `from __future__`).
tl: Any = None

_OP = "copy_blocks"


def _validate(kv_cache, block_mapping) -> tuple[int, int]:
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"{_OP}: kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{_OP}: kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"{_OP}: kv_cache dtype must be float32/float16/bfloat16/float8_e4m3fn, got {kv_cache.dtype}")
    _, _, _, bs, h, d = kv_cache.shape
    if kv_cache.numel() > 0 and (kv_cache.stride(5) != 1 or kv_cache.stride(4) != d or kv_cache.stride(3) != h * d):
        raise ValueError(
            f"{_OP}: each block of kv_cache must be contiguous ([block_size, Hkv, D] row-major), "
            f"got strides {kv_cache.stride()}"
        )
    check_index(_OP, "block_mapping", block_mapping, 2, (torch.int64, torch.int32), kv_cache.device)
    if block_mapping.shape[1] != 2:
        raise ValueError(f"{_OP}: block_mapping must be [N, 2] (src, dst), got shape {tuple(block_mapping.shape)}")
    return block_mapping.shape[0], bs * h * d


# --------------------------------------------------------------------------- torch reference


def copy_blocks_torch(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Torch reference (and CPU production path) of :func:`copy_blocks_triton`."""
    n, _ = _validate(kv_cache, block_mapping)
    if n == 0:
        return
    kv_cache = as_bytes(kv_cache)  # fp8: index_copy_ has no float8 on CPU
    if n <= _LOOP_MAX_ROWS:
        # a strided copy per row moves each block once (no gathered intermediate): ~5x faster on
        # CPU for the usual handful of copy-on-write forks per step
        for src, dst in block_mapping.tolist():
            kv_cache[:, :, dst].copy_(kv_cache[:, :, src])
        return
    mapping = block_mapping.to(torch.int64)
    src, dst = mapping[:, 0], mapping[:, 1]
    kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))


_LOOP_MAX_ROWS = 64


# --------------------------------------------------------------------------- triton kernel


def _copy_blocks_kernel(
    kv_ptr,
    mapping_ptr,
    stride_l,
    stride_kv,
    stride_b,
    stride_map,
    block_numel,
    BLOCK: tl.constexpr,
):
    # one program per (mapping row, layer * 2 + k/v)
    row = tl.program_id(0).to(tl.int64)
    lkv = tl.program_id(1)
    layer = (lkv // 2).to(tl.int64)
    which = (lkv % 2).to(tl.int64)
    src = tl.load(mapping_ptr + row * stride_map).to(tl.int64)
    dst = tl.load(mapping_ptr + row * stride_map + 1).to(tl.int64)
    base = kv_ptr + layer * stride_l + which * stride_kv
    src_ptr = base + src * stride_b
    dst_ptr = base + dst * stride_b
    for i in range(0, block_numel, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < block_numel
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


_KERNELS: dict = {}


def copy_blocks_triton(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks ``src -> dst`` for every row of ``block_mapping``, in all layers, K and V."""
    n, block_numel = _validate(kv_cache, block_mapping)
    check_triton_device(_OP, kv_cache.device)
    if n == 0 or kv_cache.numel() == 0:
        return
    if block_mapping.stride(1) != 1:
        block_mapping = block_mapping.contiguous()
    kv_cache = as_bytes(kv_cache)  # fp8: the e4m3 bits (the interpreter has no float8)
    num_layers = kv_cache.shape[0]
    kernel = lazy_jit(_KERNELS, _copy_blocks_kernel)
    block = min(4096, next_pow2(block_numel))
    kernel[(n, num_layers * 2)](
        kv_cache,
        block_mapping,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_mapping.stride(0),
        block_numel,
        BLOCK=block,
    )

