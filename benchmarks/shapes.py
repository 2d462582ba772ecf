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


def gguf_checkpoint(name: str, qtype: str = "Q4_0", seed: int = 0) -> Path:
    """Shape ``name`` as a llama.cpp GGUF (written once under benchmarks/.models/): random weights, std 0.02,
    the linears in ``qtype`` (Q4_0 or Q4_1), the token embedding (tied LM head) in Q8_0 as in the shipped
    SmolLM2 file, norms 1 in F32, and SmolLM2's GGUF tokenizer, so the vocabulary is SmolLM2's 49,152 tokens
    (llama.cpp requires the embedding's rows to equal the tokenizer's), not the shape's own. Llama shapes only:
    what both prefixserve (int4 / int8 served from the GGUF) and llama.cpp's server load."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    from engine.models.resolve import BUILTIN_MODELS, DEFAULT_MODEL, _builtin_gguf

    arch, fields = SHAPES[name]
    if arch != "llama":
        raise ValueError(f"gguf_checkpoint: {name} is a {arch} shape; only llama shapes are written as GGUF")
    path = MODELS / f"{name}-{qtype.lower()}.gguf"
    if path.exists():
        return path
    source = GGUFReader(_builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL]))
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    hidden, ffn, heads, kv_heads = (fields[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                         "num_key_value_heads"))
    head_dim = fields["head_dim"]
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"{name} (random weights, {qtype})")
    writer.add_block_count(fields["num_hidden_layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(fields["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(fields["rms_norm_eps"])
    writer.add_vocab_size(vocab)
    writer.add_file_type(LlamaFileType[f"MOSTLY_{qtype}"])
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            value = field.contents()
            writer.add_key_value(key, value, kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(seed)

    def add(tensor: str, shape: tuple[int, int] | tuple[int], kind: str) -> None:
        if kind == "F32":
            writer.add_tensor(tensor, np.ones(shape, dtype=np.float32))
            return
        data = rng.standard_normal(shape, dtype=np.float32) * 0.02
        qt = GGMLQuantizationType[kind]
        writer.add_tensor(tensor, quantize(data, qt), raw_dtype=qt)

    add("token_embd.weight", (vocab, hidden), "Q8_0")
    add("output_norm.weight", (hidden,), "F32")
    for i in range(fields["num_hidden_layers"]):
        for part, shape in (("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, heads * head_dim)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            add(f"blk.{i}.{part}.weight", shape, qtype)
        add(f"blk.{i}.attn_norm.weight", (hidden,), "F32")
        add(f"blk.{i}.ffn_norm.weight", (hidden,), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
