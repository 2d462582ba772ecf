"""Small-batch float32 / bfloat16 linear on CPU through the C kernel in csrc/linear.c.

    linear_cpu(x[M, K], weight[N, K], bias[N] | None) -> out[M, N]      (the signature of F.linear)

The torch reference is ``torch.nn.functional.linear``; this computes the same products and sums in
another order (float32 rounding apart, the same result; bfloat16 sums in float32 and rounds once,
as oneDNN's F.linear does). It covers float32 CPU tensors, and bfloat16 ones where the CPU has
AVX512-BF16, with 1 <= M <= ``max_linear_rows`` (16; bfloat16: 8) rows, a row-major weight and a contiguous input
row; anything else, or no C compiler, goes to F.linear, so it is always safe to call. See the C
file for why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .native import DTYPE_SUFFIX, NativeKernels, cpu_has_avx512, native_kernels
# bfloat16 rows the C kernel takes: above 8 it makes a second pass over each weight row, and
# oneDNN's AMX path wins (SmolLM2's 30 layers: 13/16/33 ms per step at 4/8/16 rows vs F.linear's
# 22/23/24 ms).
BF16_MAX_ROWS = 8


@dataclass(frozen=True, slots=True)
class SmallRowsWeight:
    """A linear weight in both forms, for where the C kernel beats oneDNN's packed copy at
    a few rows (:func:`rows_over_packed`): ``plain`` [N, K] (the module's own tensor, no copy) for those
    rows and ``packed`` (onednn_linear.pack_weight) for the rest."""

    plain: torch.Tensor
    packed: torch.Tensor


def rows_over_packed(dtype: torch.dtype) -> range:
    """Row counts the C kernel runs in ``dtype`` even where a packed oneDNN weight exists.

    Measured on SmolLM2's 30 layers of linears, weights streamed from memory (/tmp harness as
    benchmarks/packed_linear.py, best of 5 x 10 steps):
    - AVX2 only, float32 (2-core AMD EPYC): 1 row 20-23 ms vs oneDNN's 21-26, 4 rows 18-19 vs 25-27,
      8 rows 22-26 vs 30-33, 16 rows a tie (39-41 vs 40-46): rows 1-8.
    - AVX-512, with the kernel reading one weight row per pass (2-core AMD EPYC Zen 4): float32
      1 / 2 / 3 rows 13.8-14.4 / 14.0-14.5 / 19.4 ms vs 18.9-19.2 / 20.9-21.8 / 18.9: rows 1-2.
      bfloat16 1 / 3 / 5 / 6 / 8 rows 7.0 / 7.1 / 8.4 / 10.6 / 12.5 ms vs 10.7 / 9.7 / 9.3 / 9.6 /
      11.2: rows 1-5. (The weights alone stream in 5.3-5.7 ms in bfloat16.)
    """
    native = native_kernels()
    if native is None or native.linear_for(dtype) is None:
        return range(0)
    if dtype == torch.bfloat16:
        return range(1, 6)
    return range(1, 3) if cpu_has_avx512() else range(1, 9)


def rows_covered(native: NativeKernels, dtype: torch.dtype) -> range:
    """The row counts the C kernel takes in ``dtype`` (empty where it has none for that dtype)."""
    if native.linear_for(dtype) is None:
        return range(0)
    return range(1, 1 + (native.max_linear_rows if dtype == torch.float32 else BF16_MAX_ROWS))


def covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`linear_cpu` runs the C kernel for these operands."""
    if not (x.dim() == 2 and x.dtype in DTYPE_SUFFIX and x.device.type == "cpu"
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.is_contiguous()):
        return False
    native = native_kernels()
    return native is not None and x.shape[0] in rows_covered(native, x.dtype)


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear_covered(x, weight, bias) if covers(x, weight) else F.linear(x, weight, bias)


def linear_covered(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear_cpu` for operands the caller has already checked with :func:`covers` (the
    model's Linear does, once per call, on the decode hot path)."""
    m, k = x.shape
    n, kw = weight.shape
    if kw != k:
        raise ValueError(f"linear_cpu: x has {k} features but weight expects {kw}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"linear_cpu: bias must be {x.dtype} of shape ({n},), got {tuple(bias.shape)} {bias.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty((m, n), dtype=x.dtype)
    native_kernels().linear_for(x.dtype)(
        x.data_ptr(), weight.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(),
        m, n, k, x.stride(0), out.stride(0), torch.get_num_threads(),
    )
    return out
