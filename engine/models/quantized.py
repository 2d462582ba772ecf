"""A Llama-family model whose linears and embedding stay quantized, built straight from its GGUF file.

The modules below stand in for nn.Linear / nn.Embedding; the one forward (engine/models/llama.py)
does not change: its ``linear`` op also takes a QuantizedWeight (kernels/quant_linear.py
with_quantized_linear, bound in bind_ops). Norms and biases stay dense in the model dtype.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.progress import PROGRESS_DELAY_S, tqdm
from engine.models.gguf_weights import GGUFTensors, quantized_embedding_weight, stack, unpermute_rows
from kernels.quant_linear import QuantizedWeight

logger = logging.getLogger("prefixserve")
CONVERSION_MARKER = "prefixserve_conversion.json"  # engine/models/resolve.py writes it beside a converted GGUF


class QuantizedLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> QuantizedWeight:  # what LayerWeights.of packs (pack_weight leaves it as is)
        return self.qweight


class DenseLinear(nn.Module):
    """A linear of a quantized GGUF file stored in a float type (F32, F16, BF16): its weight in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def linear_module(weight: QuantizedWeight | torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """The module for one of a GGUF file's linears, by the layout its type maps to (gguf_weights.layout_of)."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedLinear(weight, bias)
    return DenseLinear(weight.to(dtype).contiguous(), bias)


class QuantizedEmbedding(nn.Module):
    """int8 rows with one scale per token; ``weight`` is the same table as an int8 linear (tied LM head)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = weight
        self.dtype = dtype

    @property
    def weight(self) -> QuantizedWeight:
        return self.qweight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        q = self.qweight
        return (q.packed[ids].to(self.dtype) * q.scales[ids].to(self.dtype)[:, None])


def gguf_source(folder: str | Path) -> Path | None:
    """The GGUF file a converted folder came from (None for a plain HF folder)."""
    marker = Path(folder) / CONVERSION_MARKER
    if not marker.is_file():
        return None
    source = Path(json.loads(marker.read_text()).get("source", ""))
    return source if source.is_file() else None


def _fused(tensors: GGUFTensors, names: list[str], rows: list[np.ndarray | None]) -> QuantizedWeight | torch.Tensor:
    """Several projections of one input (q, k, v / gate, up) as one weight, rows stacked."""
    return stack([tensors.unpacked(n, r) for n, r in zip(names, rows)], tensors.int4_layout)


def _bias(tensors: GGUFTensors, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
    if not all(n in tensors for n in names):
        return None
    return torch.cat([tensors.dense(n) for n in names]).to(dtype)


def quantize_model(model: nn.Module, cfg: ModelConfig, tensors: GGUFTensors, dtype: torch.dtype) -> None:
    """Replace the (meta) linears and embedding of ``model`` with quantized ones from ``tensors`` and
    load its norms; the model is then complete."""
    permute = tensors.architecture == "llama"
    q_rows = unpermute_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads) if permute else None
    k_rows = unpermute_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads) if permute else None
    for i, layer in enumerate(tqdm(model.model.layers, desc=f"reading {tensors.path.name}", unit="layer",
                                   delay=PROGRESS_DELAY_S, leave=False)):
        p = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = linear_module(
            _fused(tensors, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], [q_rows, k_rows, None]),
            _bias(tensors, [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"], dtype), dtype)
        attn.o_proj = linear_module(tensors.quantized(p + "attn_output.weight"),
                                    _bias(tensors, [p + "attn_output.bias"], dtype), dtype)
        mlp.gate_up_proj = linear_module(_fused(tensors, [p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None]),
                                         None, dtype)
        mlp.down_proj = linear_module(tensors.quantized(p + "ffn_down.weight"), None, dtype)
        norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
        if cfg.sandwich_norms:  # Gemma 3; llama.cpp stores its norms as 1 + w, the weight our norms read
            norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
        if cfg.qk_norm:
            norms.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})
        for ours, theirs in norms.items():
            layer.get_submodule(ours).weight = nn.Parameter(tensors.dense(p + theirs + ".weight").to(dtype),
                                                            requires_grad=False)
    model.model.norm.weight = nn.Parameter(tensors.dense("output_norm.weight").to(dtype), requires_grad=False)
    embedding = quantized_embedding_weight(tensors, "token_embd.weight")
    model.model.embed_tokens = QuantizedEmbedding(embedding, dtype)
    if "output.weight" in tensors:
        model.lm_head = QuantizedLinear(quantized_embedding_weight(tensors, "output.weight"), None)
    else:  # tied: the LM head reads the embedding table
        model.lm_head = QuantizedLinear(embedding, None)
    logger.info("%s served quantized: %s", tensors.path.name, tensors.summary())
