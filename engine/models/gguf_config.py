"""Facts a GGUF file implies but transformers' GGUF conversion leaves at its config defaults: fixed
in the converted folder's config.json so the model runs as llama.cpp runs the same file.

Gemma 3: GGUF carries no query_pre_attn_scalar; transformers then writes Gemma3TextConfig's default
(256). llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3) scales attention by 1/sqrt(head_dim), except
for the 27B model (62 layers), which uses 1/sqrt(hidden_size / num_heads)."""
from __future__ import annotations

import json
import pathlib
from typing import Any

GEMMA3_27B_LAYERS = 62


def fix_converted_config(meta: dict[str, Any], out: pathlib.Path) -> None:
    """Patch ``out``/config.json from the GGUF metadata ``meta`` (general.architecture and its keys)."""
    if meta.get("general.architecture") != "gemma3":
        return
    path = out / "config.json"
    config = json.loads(path.read_text())
    text = config.get("text_config", config)
    if meta.get("gemma3.block_count") == GEMMA3_27B_LAYERS:
        text["query_pre_attn_scalar"] = text["hidden_size"] // text["num_attention_heads"]
    else:
        text["query_pre_attn_scalar"] = text["head_dim"]
    path.write_text(json.dumps(config, indent=2) + "\n")
