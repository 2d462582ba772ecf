"""Gemma 3's configuration, as the one Llama-family forward (engine/models/llama.py) runs it.

Gemma 3 differs from Llama only in flags of that forward (ModelConfig):
  * RMSNorm weights mean ``1 + w`` (``norm_offset``: the loader adds the 1 once);
  * "sandwich" norms: the attention and MLP outputs are normalised before the residual add
    (post_attention_layernorm, post_feedforward_layernorm; pre_feedforward_layernorm is the MLP's
    input norm, Llama's post_attention_layernorm);
  * a GELU-tanh gated MLP; embeddings scaled by sqrt(hidden_size); attention scaled by
    ``query_pre_attn_scalar ** -0.5``; per-head q/k RMSNorm like Qwen3;
  * interleaved sliding-window ("sliding_attention", window ``sliding_window``) and global layers,
    each type with its own rope (engine/models/rope.py);
  * an optional final-logit soft cap. ``attn_logit_softcapping`` is read but not applied, as in
    transformers (5.24: Gemma3Attention never passes it to its attention function), the reference we
    match; released Gemma 3 configs leave both caps unset. The attention ops take ``softcap`` for
    architectures that apply it (kernels/masked_attention.py).

The config is read through transformers' own Gemma3TextConfig, which fills in what older
config.json files leave out (``layer_types`` from ``sliding_window_pattern``, the per-layer-type
``rope_parameters`` from ``rope_local_base_freq``) exactly as the reference model sees it.
"""
from __future__ import annotations

import logging
from pathlib import Path

from engine.errors import InvalidConfigError
from engine.models.rope import hf_text_config

logger = logging.getLogger("prefixserve")

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def gemma3_config_fields(folder: str | Path, arch: str, raw: dict, eos_token_ids: tuple[int, ...]) -> dict:
    """ModelConfig's fields for a Gemma 3 folder (engine/models/config.py builds it: this module does
    not import that one). ``raw``: the folder's config.json as read (a multimodal model ties its
    embeddings at its top level)."""
    hf = hf_text_config(folder)
    tie = raw.get("tie_word_embeddings", getattr(hf, "tie_word_embeddings", True))
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise InvalidConfigError(f"hidden_activation {act!r} is not supported; supported: {tuple(_ACTIVATIONS)}.")
    if getattr(hf, "use_bidirectional_attention", False):
        raise InvalidConfigError("use_bidirectional_attention (an embedding model's setting) is not supported.")
    rope = hf.rope_parameters.get("full_attention", hf.rope_parameters)
    if getattr(hf, "attn_logit_softcapping", None):
        logger.warning("Gemma 3: attn_logit_softcapping=%s is ignored, as transformers' Gemma 3 does.",
                       hf.attn_logit_softcapping)
    windows = tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types)
    return dict(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(tie),
        attention_bias=bool(hf.attention_bias),
        o_bias=bool(hf.attention_bias),
        mlp_bias=False,
        rope_type=rope.get("rope_type", "default"),
        sliding_window=None,  # per layer, in layer_windows
        eos_token_ids=eos_token_ids or _as_tuple(hf.eos_token_id),
        bos_token_id=hf.bos_token_id,
        qk_norm=True,
        hidden_act=_ACTIVATIONS[act],
        layer_windows=windows,
        query_scale=float(hf.query_pre_attn_scalar),
        embed_scale=hf.hidden_size ** 0.5,
        sandwich_norms=True,
        norm_offset=True,
        attn_softcap=0.0,  # ignored like transformers does (see the module docstring)
        final_softcap=float(hf.final_logit_softcapping or 0.0),
    )


def _as_tuple(value) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (() if value is None else (value,))
