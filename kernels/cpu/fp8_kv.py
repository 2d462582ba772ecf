"""The fp8 KV cache on CPU (kernels/kv_quant.py): store_kv and decode attention through the C kernels of
csrc/kv_fp8.c, prefill attention through the model-dtype C kernel on the blocks it reads, dequantized.

    store_kv_fp8_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)        C: quantize in place
    paged_attention_decode_fp8_cpu(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                   k_scale, v_scale)                                      C: read e4m3 rows
    paged_attention_prefill_fp8_cpu(query, ..., query_start_loc, scale, ...)             dequantize + C prefill

The launchers (called by kernels/cpu/store_kv.py's and paged_attention.py's for an fp8 cache) check what
their C kernel covers and otherwise take the torch references, as the model-dtype launchers do.
``fp8_cpu_ops`` binds them for the engine: raw pointers to the C kernels, what the launchers check per
call settled by the model runner's contract (kernels/cpu/ops.py's module docstring).

Why prefill dequantizes: the C prefill kernel gathers each sequence's K and V into float32 rows first
(csrc/paged_attention_prefill.c); widening e4m3 there instead would be the same work, and prefill is
bound by its products, not by reading the pool. The copy costs one pass over the blocks the step reads.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .._common import cdiv, kv_rows_packed, kv_slots_packed
from ..interface import KernelOps, debug_kernels
from ..kv_quant import dequantized_blocks
from ..paged_attention_decode import _validate as _validate_decode
from ..paged_attention_decode import paged_attention_decode_torch
from ..paged_attention_prefill import _validate as _validate_prefill
from ..store_kv import _validate as _validate_store
from ..store_kv import store_kv_torch
from .native import NativeKernels, native_kernels
from .scratch import Scratch

C_DTYPES = (torch.float32, torch.bfloat16)  # activations the C kernels take (DTYPE_SUFFIX)


def store_kv_fp8_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    t, nb, bs, hkv, d = _validate_store(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    native = native_kernels()
    if native is None or key.dtype not in C_DTYPES or not (kv_rows_packed(key) and kv_rows_packed(value)
                                                          and kv_slots_packed(k_cache) and kv_slots_packed(v_cache)):
        return store_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if t == 0:
        return
    slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() else (
        slot_mapping.to(torch.int64).contiguous())
    _store(native.store_kv_fp8_for(key.dtype), key, value, k_cache, v_cache, slots, k_scale, v_scale)


def _store(fn, key, value, k_cache, v_cache, slots, k_scale, v_scale) -> None:
    nb, bs, hkv, d = k_cache.shape
    bad = fn(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), key.shape[0],
             hkv * d, key.stride(0), value.stride(0), k_cache.stride(1), v_cache.stride(1), nb * bs, float(k_scale),
             float(v_scale))
    if bad:
        raise IndexError(f"store_kv: slot_mapping holds slots outside [0, {nb * bs})")


def paged_attention_decode_fp8_cpu(query, k_cache, v_cache, block_tables, seq_lens, scale, window: int = 0,
                                   softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    b, hq, d, nb, bs, hkv = _validate_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                             k_scale, v_scale)
    native = native_kernels()
    if native is None or not _decode_covers(native, query, k_cache, v_cache, hq // hkv, softcap):
        return paged_attention_decode_torch(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                            k_scale, v_scale)
    if b == 0:
        return query.new_empty((0, hq, d))
    lens = seq_lens.to(torch.int32).contiguous()
    longest = int(lens.max())
    if cdiv(max(longest, 0), bs) > block_tables.shape[1]:
        raise ValueError(f"paged_attention_decode: seq_len {longest} needs {cdiv(longest, bs)} blocks but "
                         f"block_tables has {block_tables.shape[1]} columns")
    table = block_tables.to(torch.int32)
    if table.stride(-1) != 1:
        table = table.contiguous()
    q = query if query.stride(-1) == 1 else query.contiguous()
    return _decode(native.decode_fp8_for(query.dtype), q, k_cache, v_cache, table, lens, scale, window, k_scale,
                   v_scale)


def _decode(fn, query, k_cache, v_cache, block_tables, seq_lens, scale, window, k_scale, v_scale) -> torch.Tensor:
    b, hq, d = query.shape
    nb, bs, hkv, _ = k_cache.shape
    out = torch.empty((b, hq, d), dtype=query.dtype)
    bad = fn(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
             out.data_ptr(), b, hq, hkv, d, bs, block_tables.stride(0), nb, query.stride(0), query.stride(1),
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
             v_cache.stride(2), out.stride(0), out.stride(1), float(scale), float(k_scale), float(v_scale), int(window),
             torch.get_num_threads())
    if bad:  # the kernel checks every block id it would read before reading any
        raise IndexError(f"paged_attention_decode: block_tables holds block ids outside [0, {nb})")
    return out


def _decode_covers(native: NativeKernels, query, k_cache, v_cache, group: int, softcap: float) -> bool:
    d, bs = k_cache.shape[3], k_cache.shape[1]
    return (query.device.type == "cpu" and query.dtype in C_DTYPES and softcap == 0
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and group <= native.max_group and d <= native.max_head_dim and bs <= native.max_block_size)


def paged_attention_prefill_fp8_cpu(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                    window: int = 0, softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
                                    *, scratch: Scratch | None = None) -> torch.Tensor:
    from .paged_attention import paged_attention_prefill_cpu  # the model-dtype launcher (imports this module)

    _validate_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, softcap,
                      k_scale, v_scale)
    k, v, tables = dequantized_blocks(k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, query.dtype)
    return paged_attention_prefill_cpu(query, k, v, tables, seq_lens, query_start_loc, scale, window, softcap,
                                       scratch=scratch)


def fp8_cpu_ops(ops: KernelOps, dtype: torch.dtype) -> KernelOps:
    """The CPU op set ``ops`` (for a ``dtype`` model) with its KV ops for an fp8 pool: bound to the C kernels
    where they cover ``dtype``, the checking launchers otherwise (or with PREFIXSERVE_DEBUG_KERNELS=1)."""
    native = native_kernels()
    scratch = Scratch()  # the prefill's gathers, reused every layer and step (kernels/cpu/scratch.py)
    prefill = functools.partial(paged_attention_prefill_fp8_cpu, scratch=scratch)
    if debug_kernels() or native is None or dtype not in C_DTYPES:
        return dataclasses.replace(ops, store_kv=store_kv_fp8_cpu, paged_attention_decode=paged_attention_decode_fp8_cpu,
                                   paged_attention_prefill=prefill)
    bound = _BoundFp8(native, dtype)
    return dataclasses.replace(ops, store_kv=bound.store_kv, paged_attention_decode=bound.decode,
                               paged_attention_prefill=prefill)


class _BoundFp8:
    """The C entry points for one activation dtype, called on the model runner's tensors: key / value rows
    packed per token, slot_mapping int64, block_tables [B, W] and seq_lens [B] int32 contiguous."""

    def __init__(self, native: NativeKernels, dtype: torch.dtype) -> None:
        self.native = native
        self.store_fn, self.decode_fn = native.store_kv_fp8_for(dtype), native.decode_fp8_for(dtype)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        _store(self.store_fn, key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, window: int = 0, softcap: float = 0.0,
               k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        n, hkv = self.native, k_cache.shape[2]
        if (query.shape[1] // hkv > n.max_group or query.shape[2] > n.max_head_dim or k_cache.shape[1] > n.max_block_size
                or softcap > 0):
            return paged_attention_decode_fp8_cpu(query, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                                  softcap, k_scale, v_scale)
        return _decode(self.decode_fn, query, k_cache, v_cache, block_tables, seq_lens, scale, window, k_scale, v_scale)
