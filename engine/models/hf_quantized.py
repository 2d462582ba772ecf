"""Hugging Face checkpoints quantized in the compressed-tensors format (vLLM's and llm-compressor's):
weight-only symmetric int4 (``pack-quantized``: eight 4-bit values per int32, a scale per group of
32-256 inputs) linears, served quantized through kernels/quant_linear.py, or dequantized with
quantization="none". Verified against transformers' own decompression (with the compressed-tensors
package). The int8 (``int-quantized``) and asymmetric (zero-point) variants are refused: this
transformers / compressed-tensors pair could not load test checkpoints of them to check against.

    w = (q - zero_point) * scale,  q signed (int4 in [-8, 7], int8 in [-127, 127])
    int4 -> our int4 groups: w = (u - 8) * scale + zero, u = q + 8 (the packed nibble), zero = -zp * scale
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.models.gguf_weights import UnsupportedQuantizationError, stack

SUPPORTED_HF = "compressed-tensors weight-only symmetric int4 with group scales (format pack-quantized)"
# Our fused modules <- the checkpoint's projections, stacked along the output rows.
PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def hf_quantization(folder: str | Path) -> dict | None:
    """The checkpoint's weight quantization scheme, or None for dense weights; refuses what we cannot run."""
    config = json.loads((Path(folder) / "config.json").read_text())
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise UnsupportedQuantizationError(f"quantization_config quant_method {method!r} is not supported; "
                                           f"supported: {SUPPORTED_HF}.")
    groups = list((qc.get("config_groups") or {}).values())
    weights = groups[0].get("weights") if len(groups) == 1 else None
    fmt = qc.get("format")
    ok = (weights is not None and not groups[0].get("input_activations") and weights.get("type") == "int"
          and fmt == "pack-quantized" and weights.get("num_bits") == 4 and weights.get("strategy") == "group"
          and weights.get("symmetric", True))
    if not ok:
        raise UnsupportedQuantizationError(f"compressed-tensors format {fmt!r} with weights {weights!r} is not "
                                           f"supported; supported: {SUPPORTED_HF}.")
    return {"bits": 4, "ignore": tuple(qc.get("ignore") or ())}


def _unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K/8] int32 -> [N, K] unsigned nibbles (value i of a word at bits 4i), as int32."""
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [N, K/8]
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return ((words[..., None] >> shifts) & 0xF).reshape(packed.shape[0], -1)[:, :k].to(torch.int32)


def unpacked(state: dict[str, torch.Tensor], name: str, bits: int) -> tuple:
    """The projection ``name`` (without ".weight") in gguf_weights' unpacked form."""
    scale = state[f"{name}.weight_scale"].float()  # [N, K/g] (int4) or [N, 1] (int8)
    if bits == 8:
        return ("int8", state[f"{name}.weight"].to(torch.int8), scale.reshape(-1))
    shape = state.get(f"{name}.weight_shape")
    k = int(shape[1]) if shape is not None else state[f"{name}.weight_packed"].shape[1] * 8
    u = _unpack_int4(state[f"{name}.weight_packed"], k)
    zp = state.get(f"{name}.weight_zero_point")
    if zp is not None and zp.dtype == torch.int32:  # packed like the weights, along the output rows
        zp = _unpack_int4(zp.t().contiguous(), scale.shape[0]).t() - 8
    zero = torch.zeros_like(scale) if zp is None else -zp.float().reshape(scale.shape) * scale
    if (k // scale.shape[1]) not in (32, 64, 128, 256):
        raise UnsupportedQuantizationError(f"{name}: int4 group size {k // scale.shape[1]} is not supported "
                                           "(32, 64, 128 or 256).")
    return ("int4", u, scale, zero)


def dense_of(parts: tuple) -> torch.Tensor:
    """The float32 weight of an unpacked projection (quantization="none")."""
    if parts[0] == "int8":
        return parts[1].float() * parts[2][:, None]
    _, u, scale, zero = parts
    n, k = u.shape
    g = k // scale.shape[1]
    return ((u.float().reshape(n, -1, g) - 8) * scale[..., None] + zero[..., None]).reshape(n, k)


def quantized_projections(state: dict[str, torch.Tensor], num_layers: int, bits: int):
    """(layer index, our module name, QuantizedWeight) for every quantized linear."""
    for i in range(num_layers):
        for ours, theirs in PROJECTIONS.items():
            yield i, ours, stack([unpacked(state, f"model.layers.{i}.{t}", bits) for t in theirs])


def dequantized_state(state: dict[str, torch.Tensor], num_layers: int, bits: int) -> dict[str, torch.Tensor]:
    """The checkpoint with dense float32 projection weights (the HF names), for quantization="none"."""
    out = dict(state)
    for i in range(num_layers):
        for theirs in (t for ts in PROJECTIONS.values() for t in ts):
            name = f"model.layers.{i}.{theirs}"
            out[f"{name}.weight"] = dense_of(unpacked(state, name, bits))
            for suffix in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
                out.pop(f"{name}.{suffix}", None)
    return out


__all__ = ["SUPPORTED_HF", "hf_quantization", "quantized_projections", "dequantized_state"]
