"""Float32 linear on x86 CPUs through oneDNN (the inner product torch ships as ``mkldnn`` ops).

    onednn_linear(x[M, K], weight[N, K], bias[N] | None) -> out[M, N]      (the signature of F.linear)

The torch reference is ``torch.nn.functional.linear``; oneDNN computes the same products and sums
in another order (float32 rounding apart, the same result; never a reduced-precision mode).

Why: in float32, F.linear calls MKL's sgemm, and MKL picks its code path by CPU vendor: on AMD it
runs generic AVX2 kernels (``mkl_blas_def_sgemm_kernel_0_zen``) even where the CPU has AVX-512.
oneDNN dispatches on the instruction set. Measured on this project's machine (AMD EPYC, 2 cores,
AVX-512): SmolLM2's linears at 2048 rows 180-200 GFLOP/s through F.linear against 420-450 through
oneDNN; one decode step's 30 layers of weights at 64 rows 99 ms against 55, at 1 row 26 against 14.
bfloat16 needs none of this: F.linear already goes to oneDNN there. vLLM's CPU backend also runs
its unquantized linears through oneDNN.

Prepacked weights (``pack_weight``): oneDNN reorders a plain weight into its blocked layout on every
call; packing each weight once, at bind, skips that. Measured on this project's machine (AMD EPYC,
2 cores, AVX-512 + AVX512-BF16, memory ~26 GB/s), SmolLM2's 30 layers of linears per step with the
weights streamed from memory (benchmarks/packed_linear.py, results/amd-avx512bf16/packed_linear.json), plain policy
-> packed: float32 1.31x at 1 row, 1.08x at 4, 1.32x at 16, 1.36x at 64, 1.18x at 1,088; bfloat16
1.44x at 16 rows and 1.23x at 64, within noise at 1-4 rows and 1,088. In the engine, single-stream
bfloat16 decode (256 tokens) took 6.0-6.5 s packed against 8.5-11.1 s plain (A/B, two rounds). So the
bound CPU ops pack every linear weight in both dtypes and run every row count through oneDNN; the C
linear stays the fallback where oneDNN is absent. The packed copy is a second copy of each weight
(the modules keep theirs, so a model can be bound again).

It covers 2-D float32 CPU operands with a contiguous weight, on x86 builds of torch that carry
oneDNN, outside autograd (the op has no backward); anything else goes to F.linear, so it is always
safe to call. ``PREFIXSERVE_ONEDNN_LINEAR=0`` turns it off (for A/B runs).
"""

from __future__ import annotations

import functools
import os
import platform

import torch
import torch.nn.functional as F

ENV_SWITCH = "PREFIXSERVE_ONEDNN_LINEAR"


@functools.cache
def onednn_linear_available() -> bool:
    """oneDNN's linear is in this torch build, on x86, and not switched off (decided once per process)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.cache
def onednn_bf16_supported() -> bool:
    """oneDNN has bfloat16 kernels on this CPU (AVX512-BF16, AMX or AVX-NE-CONVERT). Without them its
    bfloat16 weight reorder raises (measured: a 2-core AMD EPYC with AVX2 only), so bfloat16 weights
    stay plain and F.linear runs them."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`onednn_linear` runs oneDNN for these operands."""
    # A transposed (non-contiguous) weight is read as if it were row-major by the op: never pass one.
    return (x.dim() == 2 and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and onednn_linear_available())


# oneDNN picks the packed layout for a batch size; 64 rows measured as good as exact hints at 1-2,048.
PACK_BATCH_HINT = 64
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in oneDNN's blocked layout (an opaque mkldnn tensor that only
    :func:`packed_linear` reads), or ``weight`` itself where oneDNN or the dtype is not covered."""
    if not (onednn_linear_available() and weight.dtype in PACKED_DTYPES and weight.dim() == 2
            and weight.device.type == "cpu"):
        return weight
    if weight.dtype == torch.bfloat16 and not onednn_bf16_supported():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ packed weight^T (+ bias) -> [M, N], for a weight from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")  # [M, N]


def checked_packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != weight.dtype:
        raise ValueError(f"packed linear: x must be [M, {k}] {weight.dtype}, got {tuple(x.shape)} {x.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"packed linear: bias must be {x.dtype} of shape ({n},), got {tuple(bias.shape)} {bias.dtype}")
    return packed_linear(x, weight, None if bias is None else bias.contiguous())


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear_covered(x, weight, bias) if covers(x, weight) else F.linear(x, weight, bias)


def linear_covered(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`onednn_linear` for operands the caller has already checked with :func:`covers`."""
    k, (n, kw) = x.shape[1], weight.shape
    if kw != k:
        raise ValueError(f"onednn_linear: x has {k} features but weight expects {kw}")
    if bias is not None:
        if bias.shape != (n,) or bias.dtype != x.dtype:
            raise ValueError(f"onednn_linear: bias must be {x.dtype} of shape ({n},), "
                             f"got {tuple(bias.shape)} {bias.dtype}")
        bias = bias.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")  # [M, N]
