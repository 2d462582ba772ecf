"""Build our model from a resolved Hugging Face folder: config -> module -> checkpoint weights."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.errors import InvalidConfigError
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.parallel import SINGLE, TPGroup
from engine.models.rope import has_local_rope, rope_frequencies
from engine.models.gguf_weights import GGUFTensors, UnsupportedQuantizationError
from engine.models.hf_quantized import dequantized_state, hf_quantization, quantized_projections
from engine.models.quantized import QuantizedLinear, gguf_source, quantize_model
from engine.models.resolve import names_gguf
from engine.models.sharding import local_config, shard_state
from kernels.quant_linear import int4_layout_chooser


QUANTIZATION_MODES = ("gguf", "none")
logger = logging.getLogger("prefixserve")


def effective_quantization(setting: str | None, model: str) -> str | None:
    """What the loader is asked for. None / "auto": a quantized GGUF checkpoint (a .gguf file or a
    builtin name, the default model included) runs quantized, as in vLLM and llama.cpp; an HF
    folder runs as its weights are (so does the folder a GGUF was converted into, given by path)."""
    if setting not in (None, "auto"):
        return setting
    return None if names_gguf(model) else "folder"


def quantized_source(folder: str | Path, quantization: str | None, dispatch=None):
    """The GGUF tensors to serve quantized, or None to load the (dense) HF folder.

    ``quantization``: "gguf" requires a quantized GGUF source; "none" always loads dense weights;
    None (auto) serves a quantized GGUF quantized, as vLLM and llama.cpp do; "folder" (auto for a
    folder given by path) loads the folder's own weights: dense, or its quantized linears
    (compressed-tensors, GPTQ, AWQ: engine/models/hf_quantized.py)."""
    if quantization in ("none", "folder"):
        return None
    source = gguf_source(folder)
    layout = int4_layout_chooser(dispatch) if dispatch is not None else None  # measured per shape at load
    tensors = GGUFTensors(source, int4_layout=layout) if source is not None else None
    if tensors is None or not tensors.is_quantized():
        if quantization == "gguf":
            raise UnsupportedQuantizationError(
                f"quantization='gguf' needs a quantized GGUF model; {folder} has no quantized GGUF source.")
        return None
    return tensors


def load_model(folder: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               tp: TPGroup = SINGLE, quantization: str | None = "none", dispatch=None) -> LlamaForCausalLM:
    """The model, or with ``tp`` of several ranks this rank's shard of it (engine/models/sharding.py);
    with a quantized GGUF source (``quantized_source``) its linears and embedding stay quantized, their
    layouts measured by ``dispatch`` (kernels/cpu/dispatch.py) where one is given."""
    folder = Path(folder)
    inv_freq, rope_scaling = rope_frequencies(folder)
    full = cfg
    cfg = local_config(full, tp)
    # Build on the meta device: no time spent on random init of weights we overwrite anyway.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, torch.empty(cfg.head_dim // 2), rope_scaling, tp=tp, vocab_size=full.vocab_size)
    tensors = quantized_source(folder, quantization, dispatch if device.type == "cpu" else None)
    if tensors is not None and (tp.size > 1 or device.type != "cpu"):
        if quantization == "gguf":
            raise UnsupportedQuantizationError(
                "quantized GGUF weights run on one CPU process for now; pass quantization='none' for "
                "tensor parallelism or CUDA.")
        tensors = None  # auto: dense weights where the quantized kernels do not run
    if tensors is not None:
        quantize_model(model, cfg, tensors, dtype)
        model.quantization = "gguf"
        return _with_rope(model, folder, inv_freq, device)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    state = with_norm_offset(text_model_names(state), cfg)
    hf_quant = hf_quantization(folder)  # compressed-tensors / GPTQ / AWQ linears (or None: dense)
    if hf_quant is not None and quantization == "gguf":
        raise UnsupportedQuantizationError(f"quantization='gguf' needs a GGUF model; {folder} is a "
                                           f"{hf_quant['method']} checkpoint (leave quantization unset).")
    if hf_quant is not None and hf_quant["act_order"] and quantization != "none":
        logger.warning("%s: GPTQ act-order (desc_act) groups do not run through the int4 kernel; serving the "
                       "weights dequantized", folder)
    if hf_quant is not None and (quantization == "none" or hf_quant["act_order"] or tp.size > 1
                                 or device.type != "cpu"):
        state = dequantized_state(state, full.num_layers, hf_quant)  # dense where int kernels do not run
        hf_quant = None
    if hf_quant is not None:
        model.quantization = hf_quant["method"]
        for i, name, weight in quantized_projections(state, full.num_layers, hf_quant):
            model.model.layers[i].set_submodule(name, QuantizedLinear(weight, None))
    # Each rank reads the whole checkpoint, keeps its slices and drops the rest.
    state = shard_state(fuse_projections(state, cfg.num_layers), full, tp)
    if hf_quant is not None:  # biases of the quantized projections (Qwen2's q/k/v)
        for i, layer in enumerate(model.model.layers):
            for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                bias = state.get(f"model.layers.{i}.{name}.bias")
                if bias is not None:
                    layer.get_submodule(name).bias = torch.nn.Parameter(bias.to(dtype), requires_grad=False)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    if missing:
        raise InvalidConfigError(f"checkpoint in {folder} lacks weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    state = {k: v.to(dtype=dtype, device=device) for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return _with_rope(model, folder, inv_freq, device)


def _with_rope(model: LlamaForCausalLM, folder: Path, inv_freq: torch.Tensor, device: torch.device
               ) -> LlamaForCausalLM:
    model.inv_freq = inv_freq.to(device)
    if has_local_rope(folder):  # Gemma 3: sliding-window layers rotate with their own base
        model.local_inv_freq = rope_frequencies(folder, "sliding_attention")[0].to(device)
    return model.eval()


# A multimodal checkpoint's text model -> our names (transformers >= 5 writes the first form, Google's
# original Gemma 3 checkpoints the second); everything else under these models is the vision tower.
TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_model_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with a multimodal checkpoint's text-model weights under our names, the vision
    tower's dropped; a text-only checkpoint is returned as is."""
    if not any(k.startswith(p) for k in state for p, _ in TEXT_MODEL_PREFIXES):
        return state
    out = {}
    for name, tensor in state.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        for theirs, ours in TEXT_MODEL_PREFIXES:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        out[name] = tensor
    return out


def with_norm_offset(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Gemma's RMSNorm multiplies by 1 + w: store 1 + w once (in float32, before any cast), so the
    forward's norms are Llama's."""
    if not cfg.norm_offset:
        return state
    return {k: (v.float() + 1.0 if k.endswith("norm.weight") else v) for k, v in state.items()}


# Our fused parameter <- the checkpoint's parameters, concatenated along the output dimension.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{p}.{kind}" for p in parts]
                if all(n in state for n in names):
                    state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])
    return state
