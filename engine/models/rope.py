"""RoPE frequencies from a checkpoint's config, computed with transformers' own init functions
so every static rope type (default, linear, llama3, yarn) matches the reference exactly.

Gemma 3 gives each layer type its own rope (``rope_parameters`` keyed by "full_attention" and
"sliding_attention": a 1e6 base, maybe linearly scaled, for global layers; a 10k base for local
ones); ``layer_type`` picks one."""
from __future__ import annotations

from pathlib import Path

import torch


def hf_text_config(folder: str | Path):
    """transformers' config of the folder's text model (a multimodal Gemma 3's text_config)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), local_files_only=True).get_text_config()


def rope_frequencies(folder: str | Path, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2] float32, attention_scaling)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_text_config(folder)
    params = getattr(hf, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    elif "full_attention" in params:  # per-layer-type ropes, asked for the model's default
        layer_type, params = "full_attention", params["full_attention"]
    else:
        layer_type = None
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)


def has_local_rope(folder: str | Path) -> bool:
    """Whether sliding-window layers rotate with their own frequencies (Gemma 3)."""
    params = getattr(hf_text_config(folder), "rope_parameters", None) or {}
    return "sliding_attention" in params
