"""Hugging Face checkpoints whose ``quantization_config`` quantizes the linears' weights, served quantized
through kernels/quant_linear.py (int4 groups / int8 rows), or dequantized with quantization="none":

    compressed-tensors (vLLM's and llm-compressor's), weight-only:
      int4 with group scales (``pack-quantized``: eight 4-bit values per int32), symmetric or with
      zero points (``symmetric: false``, zero points packed along the output rows);
      int8 per output channel, symmetric (``int-quantized``).
    GPTQ and AWQ: engine/models/gptq_awq.py.

The tests check the dequantized weights against the libraries' own decompression (compressed-tensors'
dequantizer; transformers cannot load every variant) and the served model against transformers.

compressed-tensors: w = (q - zero_point) * scale,  q signed (int4 in [-8, 7], int8 in [-127, 127])
    int4 -> our int4 groups: w = (u - 8) * scale + zero, u = q + 8 (the packed nibble), zero = -zp * scale
    int8 -> our int8 rows: w = q * scale exactly
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.models import gptq_awq
from engine.models.gguf_weights import UnsupportedQuantizationError, stack

SUPPORTED_CT = ("compressed-tensors weight-only int4 with group scales, symmetric or with zero points (format "
                "pack-quantized), or int8 per channel, symmetric (format int-quantized)")
SUPPORTED_HF = f"{SUPPORTED_CT}; {gptq_awq.SUPPORTED_GPTQ}; {gptq_awq.SUPPORTED_AWQ}"
CT = "compressed-tensors"
CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
# Our fused modules <- the checkpoint's projections, stacked along the output rows.
PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def hf_quantization(folder: str | Path) -> dict | None:
    """The checkpoint's weight quantization scheme (a dict with "method", "bits" and "act_order"), or
    None for dense weights; UnsupportedQuantizationError naming what is supported for the rest."""
    config = json.loads((Path(folder) / "config.json").read_text())
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "gptq":
        return gptq_awq.gptq_scheme(qc)
    if method == "awq":
        return gptq_awq.awq_scheme(qc)
    if method != CT:
        raise UnsupportedQuantizationError(f"quantization_config quant_method {method!r} is not supported; "
                                           f"supported: {SUPPORTED_HF}.")
    return _compressed_tensors_scheme(qc)


def _compressed_tensors_scheme(qc: dict) -> dict:
    groups = list((qc.get("config_groups") or {}).values())
    group = groups[0] if len(groups) == 1 else {}  # one scheme for every linear
    weights, fmt = group.get("weights") or {}, group.get("format") or qc.get("format")
    int4 = fmt == "pack-quantized" and weights.get("num_bits") == 4 and weights.get("strategy") == "group"
    int8 = (fmt == "int-quantized" and weights.get("num_bits") == 8 and weights.get("strategy") == "channel"
            and weights.get("symmetric", True))
    if not (weights.get("type") == "int" and not group.get("input_activations") and (int4 or int8)):
        raise UnsupportedQuantizationError(f"compressed-tensors format {fmt!r} with weights {weights or None!r} is "
                                           f"not supported; supported: {SUPPORTED_CT}.")
    return {"method": CT, "bits": 4 if int4 else 8, "act_order": False, "ignore": tuple(qc.get("ignore") or ())}


def _unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K/8] int32 -> [N, K] unsigned nibbles (value i of a word at bits 4i), as int32."""
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [N, K/8]
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return ((words[..., None] >> shifts) & 0xF).reshape(packed.shape[0], -1)[:, :k].to(torch.int32)


def unpacked(state: dict[str, torch.Tensor], name: str, scheme: dict) -> tuple:
    """The projection ``name`` (without ".weight") in gguf_weights' unpacked form."""
    if scheme["method"] != CT:
        return gptq_awq.unpacked(state, name, scheme)
    return _ct_unpacked(state, name, scheme["bits"])


def _ct_unpacked(state: dict[str, torch.Tensor], name: str, bits: int) -> tuple:
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


def dense_weight(state: dict[str, torch.Tensor], name: str, scheme: dict) -> torch.Tensor:
    """The float32 weight [N, K] of the projection ``name`` (quantization="none")."""
    if scheme["method"] != CT:
        return gptq_awq.dense(state, name, scheme)  # honours act-order g_idx
    return dense_of(_ct_unpacked(state, name, scheme["bits"]))


def quantized_projections(state: dict[str, torch.Tensor], num_layers: int, scheme: dict):
    """(layer index, our module name, QuantizedWeight) for every quantized linear."""
    for i in range(num_layers):
        for ours, theirs in PROJECTIONS.items():
            yield i, ours, stack([unpacked(state, f"model.layers.{i}.{t}", scheme) for t in theirs])


def dequantized_state(state: dict[str, torch.Tensor], num_layers: int, scheme: dict) -> dict[str, torch.Tensor]:
    """The checkpoint with dense float32 projection weights (the HF names), for quantization="none"."""
    out = dict(state)
    for i in range(num_layers):
        for theirs in (t for ts in PROJECTIONS.values() for t in ts):
            name = f"model.layers.{i}.{theirs}"
            weight = state.get(f"{name}.weight")
            if weight is not None and weight.is_floating_point():
                continue  # a module the checkpoint left dense
            out[f"{name}.weight"] = dense_weight(state, name, scheme)
            for suffix in CT_SUFFIXES + gptq_awq.SUFFIXES:
                out.pop(f"{name}.{suffix}", None)
    return out


__all__ = ["SUPPORTED_HF", "hf_quantization", "quantized_projections", "dequantized_state"]
