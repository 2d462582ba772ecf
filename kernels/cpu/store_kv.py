"""store_kv on CPU through the C kernel in csrc/store_kv.c.

    store_kv_cpu(key[T,Hkv,D], value[T,Hkv,D], k_cache, v_cache, slot_mapping[T], k_scale=1.0, v_scale=1.0) -> None

The same signature and contract as :func:`kernels.store_kv_torch` (the reference): token ``t``'s
K and V go to flat slot ``slot_mapping[t]``, negative slots are skipped. The C kernel copies each
token's [Hkv, D] rows with memcpy, which needs them contiguous in the inputs and in the cache
slot; anything else (or no C compiler) goes to the reference. A slot past the pool raises
IndexError with nothing written, as the reference's index_copy_ does. An fp8 cache goes to
kernels/cpu/fp8_kv.py (csrc/kv_fp8.c quantizes in place).
"""

from __future__ import annotations

import torch

from .._common import kv_rows_packed, kv_slots_packed
from .fp8_kv import store_kv_fp8_cpu
from .native import native_kernels
from ..kv_quant import is_fp8
from ..store_kv import _validate, store_kv_torch

_OP = "store_kv"


def store_kv_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    if is_fp8(k_cache):
        return store_kv_fp8_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    t, nb, bs, hkv, d = _validate(key, value, k_cache, v_cache, slot_mapping)
    native = native_kernels()
    if native is None or not (kv_rows_packed(key) and kv_rows_packed(value) and kv_slots_packed(k_cache)
                              and kv_slots_packed(v_cache) and key.device.type == "cpu"):
        return store_kv_torch(key, value, k_cache, v_cache, slot_mapping)
    if t == 0:
        return
    slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() else (
        slot_mapping.to(torch.int64).contiguous())
    size = key.element_size()
    bad = native.store_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                          t, hkv * d * size, key.stride(0) * size, value.stride(0) * size,
                          k_cache.stride(1) * size, v_cache.stride(1) * size, nb * bs)
    if bad:
        raise IndexError(f"{_OP}: slot_mapping holds slots outside [0, {nb * bs})")


