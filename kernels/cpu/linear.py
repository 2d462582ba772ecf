"""float32 / bfloat16 linear on CPU through the C kernels: csrc/linear.c on a plain weight (small
batches) and csrc/lanes_linear.c on a weight packed at bind into its lanes layout (every row count
where the CPU has AVX-512; see c_kernel_rows for the policy and what it was measured on).

    linear_cpu(x[M, K], weight[N, K], bias[N] | None) -> out[M, N]      (the signature of F.linear)
    lanes_linear(x[M, K], CpuLinearWeight, bias[N] | None) -> out[M, N]

The torch reference is ``torch.nn.functional.linear``; this computes the same products and sums in
another order (float32 rounding apart, the same result; bfloat16 sums in float32 and rounds once,
as oneDNN's F.linear does). It covers float32 CPU tensors, and bfloat16 ones where the CPU has
AVX512-BF16 or AVX2 (widened to float32 in registers there), with 1 <= M <= ``max_linear_rows`` (16;
bfloat16 with AVX512-BF16: 8) rows, a row-major weight and a contiguous input row; anything else, or no C compiler, goes to F.linear, so it is always safe to call. See the C
file for why.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .hugepages import on_huge_pages
from .native import DTYPE_SUFFIX, NativeKernels, cpu_has_amx, cpu_has_avx512, native_kernels
from .widened_linear import WidenedWeight, widened_linear
# bfloat16 rows the C kernel takes: above 8 it makes a second pass over each weight row, and
# oneDNN's AMX path wins (SmolLM2's 30 layers: 13/16/33 ms per step at 4/8/16 rows vs F.linear's
# 22/23/24 ms).
BF16_MAX_ROWS = 8


EVERY_ROW = sys.maxsize  # CpuLinearWeight.small_rows when the C kernel takes every row count


@dataclass(frozen=True, slots=True)
class CpuLinearWeight:
    """A linear weight in the forms the bound CPU linear reads (:func:`c_kernel_rows` says which):

    - ``small``: the C kernel's form for 1..``small_rows`` rows: the lanes layout (:func:`pack_lanes`,
      csrc/lanes_linear.c; ``lanes`` True) where the CPU has AVX-512, else the plain weight [N, K]
      (the module's own tensor, no copy) for the row kernel (csrc/linear.c);
    - ``packed``: the GEMM form for the other row counts: oneDNN's packed copy (onednn_linear.pack_weight),
      or, for bfloat16 where oneDNN has no bfloat16 kernels, the plain weight widened per call
      (widened_linear.WidenedWeight, no copy); None where ``small`` takes every row count
      (``small_rows`` == EVERY_ROW).

    ``shape`` is the weight's (N, K). ``gated``: an MLP's gate_up weight [2I, K] whose ``small`` is the
    gated lanes layout (:func:`pack_lanes_gated`), which only the fused gate_up + SiLU-and-multiply reads
    (ops' ``linear_silu_mul``; ``packed`` is the plain weight's)."""

    small: torch.Tensor
    packed: torch.Tensor | None
    shape: tuple[int, int]
    lanes: bool
    small_rows: int
    gated: bool = False


LANES = 32  # output columns per block of the lanes layout (csrc/lanes_linear.c)


def pack_lanes(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 / bfloat16 -> the lanes layout of csrc/lanes_linear.c, zero-padded:
    float32 [ceil(N/32), K, 32]; bfloat16 [ceil(N/32), ceil(K/2), 32, 2] (k in pairs)."""
    n, k = weight.shape
    w = weight.detach()
    if weight.dtype == torch.bfloat16:
        w = F.pad(w, (0, k % 2, 0, -n % LANES))  # [Np, Kp]
        lanes = w.view(-1, LANES, w.shape[1] // 2, 2).permute(0, 2, 1, 3)  # [Np/32, Kp/2, 32, 2]
    else:
        w = F.pad(w, (0, 0, 0, -n % LANES))  # [Np, K]
        lanes = w.view(-1, LANES, k).permute(0, 2, 1)  # [Np/32, K, 32]
    return on_huge_pages(lanes.contiguous())  # streamed every step: 2 MiB pages (hugepages.py)


def pack_lanes_gated(weight: torch.Tensor) -> torch.Tensor:
    """An MLP's gate_up weight [2I, K] (gate rows, then up rows) -> the lanes layout of its rows reordered
    so that each block of 32 holds 16 gate rows and the same 16 up rows (csrc/lanes_linear.c, NAME_gated),
    each half zero-padded to a multiple of 16 rows."""
    i2, k = weight.shape
    if i2 % 2:
        raise ValueError(f"gate_up weight must have an even number of rows, got {i2}")
    half = LANES // 2
    gate, up = (F.pad(w, (0, 0, 0, -(i2 // 2) % half)) for w in weight.detach().chunk(2))  # [Ip, K] each
    pairs = torch.stack((gate.view(-1, half, k), up.view(-1, half, k)), 1)  # [Ip/16, 2, 16, K]
    return pack_lanes(pairs.reshape(-1, k))


def unpack_lanes(lanes: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The inverse of :func:`pack_lanes`: the weight [N, K] of ``shape`` (N, K)."""
    n, k = shape
    if lanes.dim() == 4:  # bfloat16 [Np/32, Kp/2, 32, 2]
        w = lanes.permute(0, 2, 1, 3).reshape(-1, lanes.shape[1] * 2)  # [Np, Kp]
    else:  # float32 [Np/32, K, 32]
        w = lanes.permute(0, 2, 1).reshape(-1, lanes.shape[1])  # [Np, K]
    return w[:n, :k].contiguous()


def unpack_lanes_gated(lanes: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The inverse of :func:`pack_lanes_gated`: the gate_up weight [2I, K] (gate rows, then up rows)."""
    i2, k = shape
    half = LANES // 2
    pairs = unpack_lanes(lanes, (lanes.shape[0] * LANES, k)).view(-1, 2, half, k)  # [Ip/16, 2, 16, K]
    gate, up = pairs[:, 0].reshape(-1, k)[: i2 // 2], pairs[:, 1].reshape(-1, k)[: i2 // 2]
    return torch.cat((gate, up)).contiguous()


def unpack_weight(form) -> torch.Tensor:
    """A weight [N, K] back from the form the bound linear reads (CpuLinearWeight, oneDNN's packed copy, or
    the plain tensor): the inverse of ops.pack_weight, exactly."""
    if type(form) is CpuLinearWeight:
        if form.lanes:
            return (unpack_lanes_gated if form.gated else unpack_lanes)(form.small, form.shape)
        return form.small
    if type(form) is WidenedWeight:
        return form.weight
    if isinstance(form, torch.Tensor) and form.is_mkldnn:
        return form.to_dense()
    return form


def row_reader(form):
    """fn(ids [T]) -> the weight's rows [T, K] read straight from its lanes layout, or None for other forms: a
    tied LM head's packed form serves the embedding lookup, so the vocabulary table is held once."""
    if type(form) is not CpuLinearWeight or not form.lanes or form.gated:
        return None
    lanes, k = form.small, form.shape[1]
    if lanes.dim() == 3:  # float32 [Np/32, K, 32]
        return lambda ids: lanes[ids // LANES, :, ids % LANES]
    return lambda ids: lanes[ids // LANES, :, ids % LANES, :].reshape(ids.shape[0], -1)[:, :k].contiguous()


def form_tensors(form) -> list[torch.Tensor]:
    """The tensors a weight's bound form holds: a CpuLinearWeight's two forms, a WidenedWeight's bfloat16
    weight, or the form itself (oneDNN's opaque tensor, or the plain weight)."""
    if type(form) is CpuLinearWeight:
        return [t for f in (form.small, form.packed) if f is not None for t in form_tensors(f)]
    if type(form) is WidenedWeight:
        return [form.weight]
    return [form] if isinstance(form, torch.Tensor) else []


def form_nbytes(form) -> int:
    """Bytes a weight's bound form holds (a storage shared by two of its forms counted once)."""
    tensors = form_tensors(form)
    if not tensors:
        return int(getattr(form, "nbytes", 0))
    held = {}
    for t in tensors:
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        held[key] = t.numel() * t.element_size()
    return sum(held.values())


def has_lanes(dtype: torch.dtype) -> bool:
    native = native_kernels()
    return dtype in DTYPE_SUFFIX and native is not None and native.lanes_for(dtype) is not None


def has_amx_linear(dtype: torch.dtype) -> bool:
    """The lanes layout also runs on AMX tiles here (csrc/amx_linear.c: bfloat16, AMX granted by the OS)."""
    native = native_kernels()
    return dtype == torch.bfloat16 and native is not None and native.amx_bf16 is not None


def lanes_launchers(dtype: torch.dtype):
    """(linear, linear_silu_mul): the checked launchers of the kernel that reads a ``dtype`` weight's lanes
    layout here: AMX tiles where :func:`has_amx_linear` (csrc/amx_linear.c), else csrc/lanes_linear.c. The
    one place this is decided; the bound ops (ops.py) ask has_amx_linear too and take the same kernel's C
    entry points."""
    if has_amx_linear(dtype):
        return amx_linear, amx_linear_silu_mul
    return lanes_linear, lanes_linear_silu_mul


def c_kernel_rows(dtype: torch.dtype) -> int:
    """How many rows (1..n) of a ``dtype`` linear the C kernel takes over oneDNN's packed weight on this
    CPU: 0 for none, EVERY_ROW for every row count.

    Measured on SmolLM2's 30 layers of linears, weights streamed from memory (benchmarks/packed_linear.py):
    - AVX-512 (the lanes kernel), 2-core AMD EPYC Zen 4, lanes / packed oneDNN (results/amd-zen4-avx512bf16/packed_linear.json):
      bfloat16 1 row 6.0 / 10.6 ms, 8 rows 6.8 / 12.2, 64 rows 34.9 / 44.2, 1,088 rows 532 / 564; float32
      1 row 13.7 / 20.1, 8 rows 11.4 / 18.8, 64 rows 66 / 79, 1,088 rows 1,113 / 1,094 (a tie): every row
      count.
    - AVX-512 with AMX, 2-core Intel Xeon (results/intel-f6m207-amx/packed_linear.json): oneDNN's bfloat16 tiles
      multiply far faster than vdpbf16ps once a step is more than the weight read: lanes / oneDNN 1 row
      10.1 / 11.0 ms, 4 rows 15.5 / 10.8, 8 rows 20.4 / 11.0, 64 rows 93 / 17.5 (taking 1-64 rows there
      had made GSP's bfloat16 decode linears 2.8 s instead of 0.7): 1 row. float32 ties to 64 rows (1 row
      20.2 / 21.7, 64 rows 67.7 / 71.7) and loses at 1,088 (892 / 801): 1-64 rows. The same layout on AMX
      tiles (csrc/amx_linear.c; results/intel-f6m207-amx/packed_linear_amx.json) beats oneDNN at 1-16 rows
      by 1.5-2x and ties it from 64 rows to a prefill chunk: every bfloat16 row count, one copy of the weight.
    - AVX2 only, float32, the row kernel (2-core AMD EPYC): 1 row 20-23 ms vs oneDNN's 21-26, 4 rows
      18-19 vs 25-27, 8 rows 22-26 vs 30-33, 16 rows a tie (39-41 vs 40-46): rows 1-8.
    - AVX2 only, bfloat16, the row kernel's AVX2 path (widened to float32 in registers; 2-core AMD EPYC Zen 3)
      against the widened GEMM (widened_linear.py): 1 row 20-23 / 44-76 ms, 8 rows 30-34 / 92-113, 16 rows
      59 / 129, 32 rows 115 / 153, 64 rows 219 / 216: rows 1-8 by flags (the bound ops measure it).
    """
    if has_lanes(dtype):
        if not cpu_has_amx():
            return EVERY_ROW
        if dtype == torch.bfloat16:  # the lanes layout on AMX tiles (csrc/amx_linear.c) where built, else vdpbf16ps
            return EVERY_ROW if has_amx_linear(dtype) else 1
        return 64
    native = native_kernels()
    if native is not None and not cpu_has_avx512() and native.linear_for(dtype) is not None:
        return 8
    return 0


def lanes_linear(x: torch.Tensor, weight: CpuLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the lanes weight^T (+ bias) -> [M, N], operands checked (the bound ops skip this)."""
    if x.dtype != weight.small.dtype:
        raise ValueError(f"lanes linear: x must be {weight.small.dtype}, got {x.dtype}")
    return _call_checked(native_kernels().lanes_for(x.dtype), "lanes linear", x, weight.small, weight.shape, bias)


def lanes_linear_silu_mul(x: torch.Tensor, weight: CpuLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_mul(x [M, K] @ the gated lanes weight^T (+ bias)) -> [M, I], operands checked (the bound ops skip
    this): the values of linear then silu_mul, bit for bit, in one pass."""
    if x.dtype != weight.small.dtype:
        raise ValueError(f"lanes linear_silu_mul: x must be {weight.small.dtype}, got {x.dtype}")
    return _call_checked(native_kernels().lanes_gated_for(x.dtype), "lanes linear_silu_mul", x, weight.small,
                         weight.shape, bias, out_cols=weight.shape[0] // 2)


def amx_linear(x: torch.Tensor, weight: CpuLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`lanes_linear` on AMX tiles (csrc/amx_linear.c), operands checked: the same layout, the same
    values up to float32 rounding."""
    if x.dtype != torch.bfloat16 or weight.small.dtype != torch.bfloat16:
        raise ValueError(f"amx linear: x and the weight must be bfloat16, got {x.dtype}, {weight.small.dtype}")
    return _call_checked(native_kernels().amx_bf16, "amx linear", x, weight.small, weight.shape, bias)


def amx_linear_silu_mul(x: torch.Tensor, weight: CpuLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`lanes_linear_silu_mul` on AMX tiles (csrc/amx_linear.c), operands checked."""
    if x.dtype != torch.bfloat16 or weight.small.dtype != torch.bfloat16:
        raise ValueError(f"amx linear_silu_mul: x and the weight must be bfloat16, got {x.dtype}, "
                         f"{weight.small.dtype}")
    return _call_checked(native_kernels().amx_gated_bf16, "amx linear_silu_mul", x, weight.small, weight.shape, bias,
                         out_cols=weight.shape[0] // 2)


def _call_checked(kernel, name: str, x: torch.Tensor, weight: torch.Tensor, shape: tuple[int, int],
                  bias: torch.Tensor | None, out_cols: int | None = None) -> torch.Tensor:
    """Checks x [M, K] and bias [N] against the weight's (N, K) = shape, then runs the C entry point, whose
    output has out_cols columns (default N)."""
    n, k = shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{name}: x must be [M, {k}], got {tuple(x.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"{name}: bias must be {x.dtype} of shape ({n},), got {tuple(bias.shape)} {bias.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    b = None if bias is None else bias.contiguous()
    cols = n if out_cols is None else out_cols
    out = torch.empty((x.shape[0], cols), dtype=x.dtype)  # [M, N] (gated: [M, I])
    kernel(x.data_ptr(), weight.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(), x.shape[0], cols, k,
           x.stride(0), cols, torch.get_num_threads())
    return out


def rows_covered(native: NativeKernels, dtype: torch.dtype) -> range:
    """The row counts the C kernel takes in ``dtype`` (empty where it has none for that dtype)."""
    if native.linear_for(dtype) is None:
        return range(0)
    if dtype == torch.float32 or not cpu_has_avx512():  # AVX2's bfloat16 path is float32's with widened loads
        return range(1, 1 + native.max_linear_rows)
    return range(1, 1 + BF16_MAX_ROWS)


def covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`linear_cpu` runs the C kernel for these operands."""
    if not (x.dim() == 2 and x.dtype in DTYPE_SUFFIX and x.device.type == "cpu"
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.is_contiguous()):
        return False
    native = native_kernels()
    return native is not None and x.shape[0] in rows_covered(native, x.dtype)


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear_covered(x, weight, bias) if covers(x, weight) else F.linear(x, weight, bias)


def plain_bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 @ a plain bfloat16 weight [N, K]^T where oneDNN has no bfloat16 kernels: the C row
    kernel for the rows it takes, the weight widened to float32 for more (widened_linear.py)."""
    return linear_covered(x, weight) if covers(x, weight) else widened_linear(x, WidenedWeight(weight))


def linear_covered(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear_cpu` for operands the caller has already checked with :func:`covers` (the
    model's Linear does, once per call, on the decode hot path)."""
    return _call_checked(native_kernels().linear_for(x.dtype), "linear_cpu", x, weight, tuple(weight.shape), bias)
