"""bfloat16 linears multiplied in float32, on CPUs without bfloat16 instructions.

    widened_linear(x[M, K] bf16, form: WidenedWeight, bias[N] bf16 | None) -> out[M, N] bf16

The torch reference is ``F.linear(x.float(), weight.float(), bias).bfloat16()``: the weight is widened
to float32 for the call (exactly: a bfloat16 is the top half of a float32), multiplied by oneDNN's
float32 GEMM, and the sums rounded to bfloat16 once, as a bfloat16 GEMM with float32 accumulation does.

Why: where neither AVX512-BF16 nor AMX is there, oneDNN has no bfloat16 kernels and torch's bfloat16
matmul is emulated. Measured on a 2-core AMD EPYC Zen 3 (AVX2 only), SmolLM2's 30 layers of linears
per step: F.linear in bfloat16 14-16 GFLOP/s at 8-2,048 rows (878 ms at 64 rows, 31 s at 2,048);
widened 96-107 GFLOP/s at 512-2,048 rows (216-243 ms at 64). Widening each call costs one read of the
bfloat16 weight and one write of a float32 copy, dropped after the call: a model holds its weights
once, in bfloat16 (a float32 copy packed at bind measured no faster at 512-2,048 rows there, and it is
twice the memory). Decode rows go to the C row kernel instead (csrc/linear.c, AVX2 bfloat16 path), which
reads the bfloat16 weight once; the bound ops measure where one hands over to the other
(kernels/cpu/choices.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import onednn_linear


@dataclass(frozen=True, slots=True)
class WidenedWeight:
    """A bfloat16 weight [N, K] (the module's own tensor, no copy) that :func:`widened_linear` multiplies
    in float32."""

    weight: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def widen(weight: torch.Tensor) -> WidenedWeight:
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"widen: a 2-D bfloat16 weight, got {tuple(weight.shape)} {weight.dtype}")
    return WidenedWeight(weight.detach().contiguous())


def widened_linear(x: torch.Tensor, form: WidenedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 @ the weight^T (+ bias), in float32 -> [M, N] bfloat16."""
    w = form.weight.float()  # [N, K]
    xf, bf = x.float(), None if bias is None else bias.float()
    out = onednn_linear.onednn_linear(xf, w, bf)  # oneDNN where it is there, F.linear otherwise
    return out.to(torch.bfloat16)


def widened_linear_reference(x: torch.Tensor, form: WidenedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.float(), form.weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
