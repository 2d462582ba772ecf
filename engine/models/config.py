"""ModelConfig: the architecture facts our model code needs, read from a HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidConfigError
from engine.models.gemma import gemma3_config_fields
from engine.models.resolve import GEMMA3_ARCHITECTURES, SUPPORTED_ARCHITECTURES

# RoPE types whose frequencies are fixed at load time. "dynamic" and "longrope" rescale with the
# running sequence length, which paged KV computed at an earlier length cannot follow.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
HIDDEN_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2, some Llamas)
    o_bias: bool
    mlp_bias: bool
    rope_type: str
    sliding_window: int | None  # unused: kept for callers; every window is in layer_windows
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    # Gemma 3 (engine/models/gemma.py reads them from its config); the defaults are Llama's.
    hidden_act: str = "silu"  # "silu" or "gelu_tanh": the gated MLP's activation
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window (0: global attention); () = all global
    query_scale: float | None = None  # attention scale = query_scale ** -0.5 (default head_dim ** -0.5)
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False  # RMSNorm after attention and after the MLP too, before the residual add
    norm_offset: bool = False  # checkpoint norm weights w mean 1 + w (the loader adds the 1)
    attn_softcap: float = 0.0  # scores -> c * tanh(score / c) (0: none)
    final_softcap: float = 0.0  # logits -> c * tanh(logit / c) (0: none)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})."
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise InvalidConfigError(f"hidden activation {self.hidden_act!r} is not supported; supported: {HIDDEN_ACTS}.")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise InvalidConfigError(f"layer_windows must give each of the {self.num_layers} layers a window >= 0.")
        if self.rope_type not in STATIC_ROPE_TYPES:
            raise InvalidConfigError(
                f"rope type {self.rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}."
            )

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` (0: it attends to every earlier position)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        return (self.query_scale or self.head_dim) ** -0.5

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, per token, per byte of element size (multiply by itemsize)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _eos_ids(folder: Path, raw: dict) -> tuple[int, ...]:
    ids: list[int] = []
    gen = folder / "generation_config.json"
    sources = [raw]
    if gen.exists():
        sources.insert(0, json.loads(gen.read_text()))
    for src in sources:
        value = src.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


def load_model_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InvalidConfigError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}.")
    if arch in GEMMA3_ARCHITECTURES:
        return ModelConfig(**gemma3_config_fields(folder, arch, raw, _eos_ids(folder, raw)))
    if raw.get("hidden_act", "silu") != "silu":
        raise InvalidConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu).")
    num_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
    # transformers >= 5 writes rope_parameters; older checkpoints (Llama 3.1, Qwen2.5) carry rope_scaling.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # our rope ops rotate the whole head
        raise InvalidConfigError(f"partial_rotary_factor {partial} is not supported (only 1.0: rope over the whole head).")
    windows = _layer_windows(arch, raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope_type=rope_type,
        sliding_window=None,  # windows are per layer (layer_windows); nothing caps max_model_len
        layer_windows=windows,
        eos_token_ids=_eos_ids(folder, raw),
        bos_token_id=raw.get("bos_token_id"),
        qk_norm=arch == "Qwen3ForCausalLM",
    )


def _layer_windows(arch: str, raw: dict) -> tuple[int, ...]:
    """Each layer's sliding window, as transformers applies it: Mistral's in every layer; Qwen2's and
    Qwen3's (use_sliding_window) in the layers its layer_types mark "sliding_attention" (by default
    those from max_window_layers on)."""
    sliding, n = raw.get("sliding_window"), raw["num_hidden_layers"]
    if not isinstance(sliding, int) or sliding <= 0:
        return ()
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not raw.get("use_sliding_window", False):
            return ()
        first = raw.get("max_window_layers", n)
        types = raw.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    else:
        types = raw.get("layer_types") or ["sliding_attention"] * n
    windows = tuple(sliding if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()
