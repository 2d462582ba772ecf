"""The decoder layer's elementwise ops: residual add + RMSNorm, SiLU-and-multiply, rotary embedding.

    add_rms_norm(x[T,H], residual[T,H] | None, weight[H], eps) -> (out[T,H], new_residual[T,H])
    silu_mul(gate_up[T,2I]) -> out[T,I]       gelu_tanh_mul(gate_up[T,2I]) -> out[T,I] (Gemma)
    rope(x[T,NH,D], cos[T,D/2], sin[T,D/2]) -> out[T,NH,D]

Here are the torch references (``<op>_torch``: the arithmetic of HF transformers' Llama, rounding
to the model dtype where HF does); the CPU launchers with the same signatures, over the fused C
kernels, are in kernels/cpu/elementwise.py.

Without a residual, ``add_rms_norm`` returns ``(rms_norm(x), x)``; with one, ``new_residual =
x + residual`` and ``out = rms_norm(new_residual)`` (vLLM's fused_add_rms_norm, out of place).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F



# --------------------------------------------------------------------------- torch references


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    # Normalise in float32 and cast back before the weight, exactly as HF does, so float32 and
    # bfloat16 runs round the same way as the reference implementation.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up


def gelu_tanh_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP activation (transformers' gelu_pytorch_tanh): gelu_tanh(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.gelu(gate, approximate="tanh") * up


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, NH, D]; cos/sin: [T, D/2]. HF's x*cat(c,c) + rotate_half(x)*cat(s,s), written on the
    # two halves: the same multiplies and adds per element (bit-identical), without rotate_half's
    # extra full-size temporaries.
    x1, x2 = x.chunk(2, dim=-1)  # [T, NH, D/2] each
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
