"""Greedy outputs equal HF transformers generate() on the same float32 weights (near-tie rule in conftest)."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

from engine_testlib import assert_greedy_match, hf_greedy


def _mixed_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_tiny_models_match_hf(arch, block_size, tiny_model_factory, hf_model_loader):
    path = tiny_model_factory(arch)
    # Some prompts are longer than max_num_batched_tokens, so chunked prefill runs beside decodes.
    llm = LLM(model=str(path), block_size=block_size, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=8)
    vocab = llm.engine.model_config.vocab_size
    prompts = _mixed_prompts(vocab, [5, 17, 150, 1, 64, 33, 90, 8])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    refs = hf_greedy(hf_model_loader(path), prompts, 12)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"{arch} prompt {i}")
    usage = llm.kv_cache_usage()
    assert usage["num_in_use"] == 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_per_head_norms_with_one_kv_head_match_hf(arch, tiny_model_factory, hf_model_loader):
    """Per-head q/k norms over a single KV head read the k rows as a strided view of the qkv projection (no
    copy), as Gemma 3 270M's do; the bound CPU norm once took its rows as contiguous and answered garbage."""
    path = tiny_model_factory(arch, num_kv_heads=1)
    llm = LLM(model=str(path), num_kv_blocks=128, max_num_batched_tokens=64, max_num_seqs=4)
    prompts = _mixed_prompts(llm.engine.model_config.vocab_size, [9, 40, 3, 70], seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy(hf_model_loader(path), prompts, 10))):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"{arch} with one KV head, prompt {i}")


@pytest.mark.real_model
def test_smollm2_matches_hf(smollm2_path, hf_model_loader):
    llm = LLM(model=str(smollm2_path), num_kv_blocks=512, max_num_batched_tokens=128, max_num_seqs=8)
    tok = llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "In a distant galaxy, " * 12,  # long enough to be chunked (> 128 tokens? ~ 72; add below)
        "Water boils at",
        "List three colors:",
        " ".join(f"item{i}" for i in range(80)),  # > max_num_batched_tokens: chunked prefill
    ]
    prompts = [tok(t).input_ids for t in texts]
    assert max(len(p) for p in prompts) > 128
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    refs = hf_greedy(hf_model_loader(smollm2_path), prompts, 24)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"smollm2 prompt {i}")
    assert llm.kv_cache_usage()["num_in_use"] == 0


def test_tiny_pool_forces_preemption_same_output(tiny_model_factory, hf_model_loader):
    path = tiny_model_factory("qwen2")
    # 12 blocks of 8 tokens: 6 prompts of ~30 tokens + 16 outputs cannot all be resident.
    llm = LLM(model=str(path), block_size=8, num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=6)
    vocab = llm.engine.model_config.vocab_size
    prompts = _mixed_prompts(vocab, [30, 28, 31, 25, 29, 27], seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    refs = hf_greedy(hf_model_loader(path), prompts, 16)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"preempted prompt {i}")
    assert llm.kv_cache_usage()["num_in_use"] == 0
    llm.engine.check_integrity()
