"""RoPE frequencies from a checkpoint's config, computed with transformers' own init functions
so every static rope type (default, linear, llama3, yarn) matches the reference exactly."""
from __future__ import annotations

from pathlib import Path

import torch


def rope_frequencies(folder: str | Path) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2] float32, attention_scaling)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scaling)
