"""The tiny_model_factory fixture: shapes, determinism, caching, and clear greedy margins."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.models.resolve import model_fingerprint, resolve_model
from fixtures.tiny_models import make_tiny_model

EXPECTED = {
    # arch: (class, kv heads, has q/k/v bias)
    "llama": ("LlamaForCausalLM", 4, False),
    "qwen2": ("Qwen2ForCausalLM", 2, True),
    "qwen3": ("Qwen3ForCausalLM", 2, False),
    "mistral": ("MistralForCausalLM", 1, False),
}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_tiny_model_loads_and_runs(tiny_model_factory, arch):
    cls_name, kv_heads, has_bias = EXPECTED[arch]
    folder = tiny_model_factory(arch)
    assert resolve_model(folder) == folder.resolve()
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = model.config
    assert type(model).__name__ == cls_name
    assert model.dtype == torch.float32
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert cfg.num_key_value_heads == kv_heads
    assert getattr(cfg, "head_dim", 16) == 16 and cfg.intermediate_size == 128
    assert cfg.vocab_size == len(tok) == 49152
    assert cfg.max_position_embeddings == 1024 and tok.model_max_length == 1024
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert tok.chat_template

    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) == has_bias
    if has_bias:
        assert attn.k_proj.bias.abs().sum() > 0  # random, not zero-initialised
    assert model.model.norm.weight.std() > 0  # norms are randomised around 1 too

    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_greedy_margins_are_clear(tiny_model_factory, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch))
    tok = AutoTokenizer.from_pretrained(tiny_model_factory(arch))
    gaps = []
    for prompt in ("Hello, my name is", "def fibonacci(n):", "Once upon a time"):
        inputs = tok(prompt, return_tensors="pt")
        out = model.generate(
            **inputs, max_new_tokens=16, do_sample=False, output_scores=True, return_dict_in_generate=True,
            eos_token_id=None, pad_token_id=2,
        )  # fmt: skip
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
    small = sum(g < 1e-3 for g in gaps) / len(gaps)
    assert small <= 0.05, (small, sorted(gaps)[:5])


def test_factory_caches_per_parameter_set(tiny_model_factory):
    a = tiny_model_factory("llama")
    assert tiny_model_factory("llama") == a
    b = tiny_model_factory("llama", num_kv_heads=2)
    assert b != a
    assert json.loads((b / "config.json").read_text())["num_key_value_heads"] == 2


def test_deterministic_weights(tiny_model_factory, smollm2_path, tmp_path):
    first = tiny_model_factory("mistral")
    again = make_tiny_model(tmp_path / "again", "mistral", tokenizer_dir=smollm2_path)
    other_seed = make_tiny_model(tmp_path / "seed1", "mistral", tokenizer_dir=smollm2_path, seed=1)
    w1, w2, w3 = (load_file(str(p / "model.safetensors")) for p in (first, again, other_seed))
    assert w1.keys() == w2.keys()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["model.embed_tokens.weight"], w3["model.embed_tokens.weight"])
    assert model_fingerprint(first) == model_fingerprint(again)
    assert model_fingerprint(first) != model_fingerprint(other_seed)


def test_variants(tiny_model_factory):
    tied = tiny_model_factory("llama", tie_word_embeddings=True, attention_bias=True)
    model = AutoModelForCausalLM.from_pretrained(tied)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.q_proj.bias is not None

    scaled = tiny_model_factory("qwen2", rope_scaling={"rope_type": "linear", "factor": 2.0}, num_kv_heads=1)
    cfg = AutoModelForCausalLM.from_pretrained(scaled).config
    assert cfg.rope_parameters["rope_type"] == "linear" and cfg.rope_parameters["factor"] == 2.0
    assert cfg.num_key_value_heads == 1

    with pytest.raises(ValueError):
        tiny_model_factory("gpt2")
    with pytest.raises(ValueError):
        tiny_model_factory("mistral", attention_bias=True)
