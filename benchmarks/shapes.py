"""Random-weight checkpoints of real model shapes, for measuring speed at the sizes users run (speed does not
depend on weight values; ``ignore_eos`` fixes output lengths). Each is an HF folder both prefixserve and the
peers load: config.json, model.safetensors (bfloat16, std 0.02, norms 1) and a word-level tokenizer with
the model's own vocabulary size (every id the random model emits detokenizes).

    checkpoint("llama-3.2-1b") -> Path        written once under benchmarks/.models/ (git-ignored)
    model_path(name) -> Path                  a shape's checkpoint, or any model prefixserve resolves

Shapes: "qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b" (the configs' published sizes).
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = HERE / ".models"
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                 max_position_embeddings=40960, rms_norm_eps=1e-6)),
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                                   rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=131072, rms_norm_eps=1e-5)),
    "llama-3.1-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                                   rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=131072, rms_norm_eps=1e-5)),
}


def config_of(name: str):
    from transformers import LlamaConfig, Qwen3Config

    arch, fields = SHAPES[name]
    config = (Qwen3Config if arch == "qwen3" else LlamaConfig)(bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                                initializer_range=0.02, **fields)
    config.architectures = ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"]
    return config


def checkpoint(name: str, folder: Path | None = None, seed: int = 0) -> Path:
    """The folder of shape ``name`` (written on first use): random bfloat16 weights, std 0.02, norms 1."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = folder or MODELS / name
    if (folder / "model.safetensors").exists():
        return folder
    config = config_of(name)
    with torch.device("meta"):  # names and shapes only: no memory, no init
        names = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    state = {k: (torch.ones(s) if "norm" in k else torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
             for k, s in names.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    write_word_tokenizer(folder, config.vocab_size, config.max_position_embeddings)
    return folder


def write_word_tokenizer(folder: Path, vocab: int, max_length: int) -> None:
    """A word-level tokenizer with ``vocab`` tokens ("<unk>", "<s>", "</s>", then t3, t4, ...): every id a
    random model emits detokenizes, at the model's own vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<unk>", "model_max_length": max_length}))


def model_path(name: str) -> Path:
    """A benchmark's --model: a shape above (its random checkpoint, written on first use), else what
    prefixserve resolves (a builtin name, an HF folder, a GGUF file)."""
    if name in SHAPES:
        return checkpoint(name)
    from engine.models.resolve import resolve_model

    return Path(resolve_model(name))
