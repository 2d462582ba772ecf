"""CPU launchers of the decoder layer's elementwise ops over the fused C kernels (csrc/add_rms_norm.c,
csrc/silu_mul.c, csrc/rope.c), with the signatures of the references in kernels/elementwise.py.

Each checks shapes and strides; anything the C kernel does not cover (another device or dtype, odd
strides, no C compiler) goes to the reference, so the launchers are always safe to call.
``rope_cpu`` writes into ``x`` (the reference returns a new tensor): the model passes it the q/k
slice of a fresh qkv projection and uses only the returned tensor.
"""

from __future__ import annotations

import torch

from ..elementwise import add_rms_norm_torch, rope_torch, silu_mul_torch
from .native import DTYPE_SUFFIX, native_kernels


# --------------------------------------------------------------------------- CPU launchers


def _kernel(op: str, *tensors: torch.Tensor):
    """The C kernel for ``op`` when every tensor is a CPU tensor of one covered dtype, else None."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_SUFFIX or any(t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return None
    native = native_kernels()
    return None if native is None else native.elementwise_for(op, dtype)


def _rows(t: torch.Tensor) -> bool:  # a [rows, width] matrix whose rows are contiguous
    return t.dim() == 2 and t.stride(1) == 1


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    operands = (x, weight) if residual is None else (x, residual, weight)
    fn = _kernel("add_rms_norm", *operands)
    if fn is None or not _rows(x) or not weight.is_contiguous() or (residual is not None and not _rows(residual)):
        return add_rms_norm_torch(x, residual, weight, eps)
    rows, h = x.shape
    if weight.shape != (h,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = x if residual is None else torch.empty_like(out)
    fn(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
       new_residual.data_ptr(), out.data_ptr(), rows, h,
       x.stride(0), 0 if residual is None else residual.stride(0), new_residual.stride(0), out.stride(0),
       float(eps), torch.get_num_threads())
    return out, new_residual


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    fn = _kernel("silu_mul", gate_up)
    if fn is None or not _rows(gate_up) or gate_up.shape[1] % 2:
        return silu_mul_torch(gate_up)
    rows, width = gate_up.shape
    out = gate_up.new_empty((rows, width // 2))
    fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, gate_up.stride(0), out.stride(0),
       torch.get_num_threads())
    return out


def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    fn = _kernel("rope", x, cos, sin)
    heads_packed = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]  # [T, NH, D], rows of NH*D
    tables = _rows(cos) and _rows(sin) and cos.stride(0) == sin.stride(0)
    if fn is None or not heads_packed or not tables:
        return rope_torch(x, cos, sin)
    rows, nh, d = x.shape
    if d % 2 or cos.shape != (rows, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope: x {tuple(x.shape)} needs cos/sin of shape ({rows}, {d // 2}), "
                         f"got {tuple(cos.shape)} / {tuple(sin.shape)}")
    fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, nh, d, x.stride(0), cos.stride(0),
       torch.get_num_threads())
    return x
