"""Sliding-window attention through the block tables for the models that set one in their config:
Mistral (every layer) and Qwen2 / Qwen3 with use_sliding_window (the layers layer_types marks). Greedy
parity with HF where the prompts run far past the window, and max_model_len is no longer capped at it."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.models.config import _layer_windows

from engine_testlib import assert_greedy_match, hf_greedy


@pytest.mark.parametrize("block_size", [8, 16])
def test_mistral_window_matches_hf(block_size, tiny_model_factory, hf_model_loader):
    path = tiny_model_factory("mistral", sliding_window=12, max_position_embeddings=512)
    llm = LLM(model=str(path), block_size=block_size, num_kv_blocks=256, max_num_batched_tokens=48, max_num_seqs=8)
    assert llm.engine.model_config.layer_windows == (12, 12)
    assert llm.engine.max_model_len == 512  # not capped at the window any more
    rng = random.Random(4)
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in (3, 30, 100, 12, 61)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy(hf_model_loader(path), prompts, 16))):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"mistral window prompt {i}")
    llm.engine.check_integrity()


@pytest.mark.parametrize("raw,expected", [
    ({"sliding_window": 8, "num_hidden_layers": 3}, (8, 8, 8)),  # Mistral: every layer
    ({"sliding_window": None, "num_hidden_layers": 3}, ()),
    ({"sliding_window": 8, "num_hidden_layers": 3, "use_sliding_window": False, "qwen": True}, ()),
    ({"sliding_window": 8, "num_hidden_layers": 3, "use_sliding_window": True, "max_window_layers": 1, "qwen": True},
     (0, 8, 8)),
    ({"sliding_window": 8, "num_hidden_layers": 2, "use_sliding_window": True, "qwen": True,
      "layer_types": ["sliding_attention", "full_attention"]}, (8, 0)),
])
def test_layer_windows_follow_transformers(raw, expected):
    arch = "Qwen3ForCausalLM" if raw.pop("qwen", False) else "MistralForCausalLM"
    assert _layer_windows(arch, raw) == expected
