"""Paged attention on CPU through the C kernels: decode (csrc/paged_attention_decode.c) and prefill
(csrc/paged_attention_prefill.c).

    paged_attention_decode_cpu(query[B,Hq,D], k_cache, v_cache, block_tables[B,max_blocks],
                               seq_lens[B], scale) -> out[B,Hq,D]
    paged_attention_prefill_cpu(query[T,Hq,D], k_cache, v_cache, block_tables[S,max_blocks],
                                seq_lens[S], query_start_loc[S+1], scale) -> out[T,Hq,D]

The same signatures and contracts as :func:`kernels.paged_attention_decode_torch` and
:func:`kernels.paged_attention_prefill_torch` (the references); the launchers check shapes and
strides and hand raw pointers to the C kernels, which check the block ids they will read before
reading any. Anything a C kernel does not cover (float16, a group or head larger than it was built
for, a soft cap or, in prefill, a sliding window shorter than a sequence -- kernels/masked_attention.py --
or no C compiler) goes to the torch reference, so these functions are always safe to call. The decode
kernel reads only a sliding window's positions itself.

Shared prefixes (forks, beams, cache hits) go through the C kernel too. Where enough query rows
share enough keys (csrc/paged_attention_decode.c: 16 rows, 64 keys, AVX-512 or AVX2 only) the kernel attends the shared keys once for all of them with the
prefill kernel's flash items and each sequence goes on from their softmax state; otherwise each
sequence reads the shared blocks itself, from cache. Measured per layer on a 2-core AMD EPYC Zen 5
(4 x 16 sequences over 1,024 shared tokens, bfloat16): 1.33-1.54 -> 0.55-0.92 ms (the shared cases of
benchmarks/cpu_kernels.py, results/amd-zen5-avx512bf16/cpu_kernels.json); GSP's bfloat16
decode attention 1.35 -> 0.79 s (`benchmarks/profile_gsp.py`); in float32, 4 x 16 1.52-1.63 -> 1.00-1.07 ms
and 8 samples 0.18 -> 0.14 ms. The C kernels take their scratch
memory from the caller (kernels/cpu/scratch.py); the bound op set keeps one. An fp8 cache goes to
kernels/cpu/fp8_kv.py (``k_scale`` / ``v_scale`` are ignored otherwise).
"""

from __future__ import annotations

import ctypes

import torch

from .._common import cdiv
from .fp8_kv import paged_attention_decode_fp8_cpu, paged_attention_prefill_fp8_cpu
from .native import NativeKernels, cpu_has_amx, cpu_has_avx2, cpu_has_avx512, native_kernels
from ..kv_quant import is_fp8
from .scratch import Scratch
from ..masked_attention import window_or_softcap_applies
from ..paged_attention_decode import _validate, paged_attention_decode_torch
from ..paged_attention_prefill import _validate as _validate_prefill
from ..paged_attention_prefill import check_sequences, paged_attention_prefill_torch

_OP = "paged_attention_decode"
_PREFILL_OP = "paged_attention_prefill"


def paged_attention_decode_cpu(
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
    *,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Decode attention over the paged KV cache with the CPU C kernel (torch fallback). ``scratch``:
    the caller's reusable memory for the shared-prefix work (a fresh one per call without it).

    float32 and bfloat16, the math in float32, except that with AVX512-BF16 bfloat16 runs both products
    on bf16 pairs (vdpbf16ps), the probabilities rounded to bfloat16 before P.V as in prefill: within
    2^-9 of the largest |V| of the float32 math, 1.4x faster per layer (csrc/paged_attention_decode.c)."""
    if is_fp8(k_cache):
        return paged_attention_decode_fp8_cpu(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                              k_scale, v_scale)
    b, hq, d, nb, bs, hkv = _validate(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)
    native = native_kernels()
    if native is None or not _supported(native, query, k_cache, v_cache, hq // hkv, d, bs) or softcap > 0:
        return paged_attention_decode_torch(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)
    if b == 0:
        return query.new_empty((0, hq, d))
    lens = seq_lens.to(torch.int32).contiguous()
    longest = int(lens.max())
    if cdiv(max(longest, 0), bs) > block_tables.shape[1]:
        raise ValueError(
            f"{_OP}: seq_len {longest} needs {cdiv(longest, bs)} blocks but block_tables has "
            f"{block_tables.shape[1]} columns"
        )
    table = block_tables.to(torch.int32)
    if table.stride(-1) != 1:
        table = table.contiguous()
    q = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty((b, hq, d), dtype=query.dtype)
    fn = native.decode_for(query.dtype)
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), lens.data_ptr(), out.data_ptr(),
            b, hq, hkv, d, bs, table.stride(0), nb,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1),
            float(scale), int(window), torch.get_num_threads())
    call_decode(fn, args, Scratch() if scratch is None else scratch, nb)
    return out


def call_decode(fn, args: tuple, scratch: Scratch, nb: int) -> None:
    """The C decode entry with `scratch` for its shared-prefix work, grown and called again when the
    kernel asks for more (it computes nothing then)."""
    need = ctypes.c_int64(0)
    bad = fn(*args, scratch.data_ptr(), scratch.floats, ctypes.addressof(need))
    if bad == 3:
        buf = scratch.take(need.value)
        bad = fn(*args, buf.data_ptr(), buf.numel(), ctypes.addressof(need))
    if bad == 2:
        raise MemoryError(f"{_OP}: no memory to plan the shared-prefix work")
    if bad:  # the kernel checks every block id it would read before reading any
        raise IndexError(f"{_OP}: block_tables holds block ids outside [0, {nb})")


def _supported(native: NativeKernels, query, k_cache, v_cache, group: int, d: int, bs: int) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        and group <= native.max_group and d <= native.max_head_dim and bs <= native.max_block_size
    )


def paged_attention_prefill_cpu(
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
    *,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Causal prefill attention over the paged KV cache with the CPU C kernel (torch fallback).
    ``scratch``: the caller's reusable memory for the gathered K and V (a fresh one without it).

    float32 and bfloat16, the math in float32 either way, except that with AVX512-BF16 the bfloat16
    products run on bfloat16 pairs (vdpbf16ps) with the probabilities rounded to bfloat16 before P.V:
    measured 1.2-1.9x faster than widening to float32 (benchmarks/cpu_kernels.py --cases prefill on a
    2-core AMD EPYC Zen 5: 5x410 tokens 5.0 -> 4.0 ms, 1x2048 15.6 -> 8.6, a 512 chunk after 1,536
    cached 6.6 -> 3.5, after-side in results/amd-zen5-avx512bf16/cpu_kernels.json; GSP's prefill attention 3.4 -> 0.9 s), within 2^-9 of the largest |V| of the
    float32 math. Sums run in another order than
    SDPA's: float32 results agree to float32 rounding. With AMX, bfloat16 runs both products on AMX tiles
    (csrc/flash_amx.h; vdpbf16ps issues every second cycle on the 2-core Xeon measured): per layer
    1x2048 6.5-6.7 ms vs SDPA's 13.0 (SDPA also multiplies on AMX), a 512 chunk after 1,536 1.8-2.0x
    SDPA; a library built without the AMX item leaves bfloat16 on AMX CPUs to the reference (SDPA)."""
    if is_fp8(k_cache):
        return paged_attention_prefill_fp8_cpu(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                               window, softcap, k_scale, v_scale, scratch=scratch)
    t, hq, d, s, nb, bs, hkv = _validate_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                                 window, softcap)
    native = native_kernels()
    if (native is None or not _prefill_supported(native, query, k_cache, v_cache, d)
            or window_or_softcap_applies(seq_lens, window, softcap)):
        return paged_attention_prefill_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                             window, softcap)
    qsl, lens = check_sequences(query_start_loc, seq_lens, t, block_tables.shape[1], bs)
    out = query.new_empty((t, hq, d))
    if t == 0:
        return out
    # The kernel's float32 copy of K and V (widened from bfloat16): each sequence with queries,
    # rounded up to 16 positions (32 on AMX tiles, the most any layout takes).
    ws_floats = sum(cdiv(n, 32) * 32 for i, n in enumerate(lens) if qsl[i + 1] > qsl[i]) * 2 * hkv * d
    ws = (Scratch() if scratch is None else scratch).take(ws_floats)
    table = block_tables.to(torch.int32)
    if table.stride(-1) != 1:
        table = table.contiguous()
    q = query if query.stride(-1) == 1 else query.contiguous()
    # Held in names until the call returns: only their raw pointers travel.
    lens_t, qsl_t = seq_lens.to(torch.int32).contiguous(), query_start_loc.to(torch.int32).contiguous()
    err = native.prefill_for(query.dtype)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
        lens_t.data_ptr(), qsl_t.data_ptr(),
        out.data_ptr(), ws.data_ptr(), ws_floats, s, hq, hkv, d, bs, table.stride(0), nb,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        float(scale), torch.get_num_threads())
    if err == 1:  # the kernel checks every block id it would read before reading any
        raise IndexError(f"{_PREFILL_OP}: block_tables holds block ids outside [0, {nb})")
    if err:  # the launcher's own checks rule these out: reaching here is a bug, never silent
        raise RuntimeError(f"{_PREFILL_OP}: C kernel refused its arguments (code {err})")
    return out


def _prefill_supported(native: NativeKernels, query, k_cache, v_cache, d: int) -> bool:
    # With AVX-512 or AVX2 (flash_item.h has an 8-lane item for it): the portable item's 16-lane vectors
    # measured 10x slower than torch's flash attention there.
    return (
        query.device.type == "cpu" and (cpu_has_avx512() or cpu_has_avx2())
        and (query.dtype == torch.float32
             or (query.dtype == torch.bfloat16 and (not cpu_has_amx() or (native.prefill_amx and d % 64 == 0))))
        and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        and d <= native.max_prefill_head_dim and d % native.prefill_head_dim_multiple == 0
    )
