"""n>1 sampling and beam search as copy-on-write forks of one prompt."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _blocks(tokens: int, block_size: int = 16) -> int:
    return -(-tokens // block_size)


@pytest.fixture(scope="module")
def long_llama(tiny_model_factory):
    return tiny_model_factory("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def llm(long_llama):
    return LLM(model=str(long_llama), num_kv_blocks=400, max_num_batched_tokens=512, max_num_seqs=16)


# -- n > 1 --------------------------------------------------------------------------------------
def test_greedy_samples_are_identical(llm):
    out = llm.generate({"prompt_token_ids": _ids(37, 1)}, SamplingParams(n=4, temperature=0, max_tokens=10,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 1


def test_integrity_holds_after_every_step_while_samples_wait_to_fork(long_llama):
    """Before the prompt is computed the samples are the root's pending forks: live for the request,
    unknown to the scheduler, holding no blocks (check_integrity failed on a fresh engine here)."""
    engine = LLM(model=str(long_llama), num_kv_blocks=64, max_num_batched_tokens=16).engine
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=1, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": _ids(40, 3)}, params)  # 3 prefill chunks before the fork
    engine.check_integrity()
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
        engine.check_integrity()
    assert [len(o.token_ids) for o in finished[0].outputs] == [6, 6, 6]


def test_seeded_samples_are_distinct_and_equal_single_requests_with_seed_plus_i(llm):
    prompt = {"prompt_token_ids": _ids(45, 2)}  # ends mid-block: the forks share a partial block
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=100, ignore_eos=True)
    group = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    tokens = [o.token_ids for o in group.outputs]
    assert tokens == [o.token_ids for o in again.outputs]  # reproducible
    assert len({tuple(t) for t in tokens}) == 4  # distinct
    for i in range(4):  # sample i is exactly a lone request seeded seed + i
        single = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=100 + i, ignore_eos=True),
                              use_tqdm=False)[0]
        assert single.outputs[0].token_ids == tokens[i]
    assert llm.kv_cache_usage()["num_in_use"] == 0
    llm.engine.check_integrity()


def test_n8_of_a_1024_token_prompt_holds_the_prompt_once(long_llama):
    llm = LLM(model=str(long_llama), num_kv_blocks=400, max_num_batched_tokens=1024, max_num_seqs=8,
              enable_prefix_caching=False)
    out = llm.generate({"prompt_token_ids": _ids(1024, 3)}, SamplingParams(n=8, temperature=0.8, max_tokens=32,
                                                                          seed=1, ignore_eos=True), use_tqdm=False)[0]
    assert all(len(o.token_ids) == 32 for o in out.outputs)
    usage = llm.kv_cache_usage()
    bound = _blocks(1024) + 8 * (_blocks(32) + 1) + 8
    assert usage["peak_in_use"] <= bound, (usage, bound)
    assert usage["num_in_use"] == 0


def test_forked_samples_follow_the_single_sample_distribution(tiny_model_factory, hf_model_loader):
    """First tokens of forked samples (i >= 1) against the model's exact top-k distribution."""
    path = tiny_model_factory("llama")
    llm = LLM(model=str(path), num_kv_blocks=256, max_num_seqs=8)
    prompt = _ids(20, 4)
    top_k = 4
    logits = hf_model_loader(path)(torch.tensor([prompt])).logits[0, -1].float()
    top = logits.topk(top_k)
    expected = dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))
    counts: Counter[int] = Counter()
    outs = llm.generate([{"prompt_token_ids": prompt}] * 40,
                        [SamplingParams(n=8, temperature=1.0, top_k=top_k, max_tokens=1, seed=1000 + 8 * r)
                         for r in range(40)], use_tqdm=False)
    for out in outs:
        counts.update(o.token_ids[0] for o in out.outputs[1:])  # only forked samples
    total = sum(counts.values())
    assert set(counts) <= set(expected)
    chi2 = sum((counts[t] - total * p) ** 2 / (total * p) for t, p in expected.items())
    # 3 degrees of freedom: P(chi2 > 16.27) = 0.001. Fails only if forks sample a different distribution.
    assert chi2 < 16.27, (counts, expected)


def test_abort_and_preemption_of_forked_groups_leak_nothing(long_llama):
    llm = LLM(model=str(long_llama), block_size=8, num_kv_blocks=40, max_num_batched_tokens=64, max_num_seqs=8)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=7, ignore_eos=True)
    prompts = [{"prompt_token_ids": _ids(30, 10 + i)} for i in range(3)]
    outs = llm.generate(prompts, params, use_tqdm=False)  # 3 groups x 4 samples cannot all fit: preemption
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.kv_cache_usage()["num_in_use"] == 0
    llm.engine.check_integrity()
    roomy = LLM(model=str(long_llama), block_size=8, num_kv_blocks=400, max_num_batched_tokens=64, max_num_seqs=16)
    expect = roomy.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs, expect):  # a preempted group resumes to exactly the same samples
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    engine = llm.engine
    engine.add_request("g", prompts[0], params)
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_usage()["num_in_use"] > 0
    engine.abort("g")
    engine.check_integrity()
    assert engine.kv_cache_usage()["num_in_use"] == 0 and not engine.has_unfinished()


# -- beam search --------------------------------------------------------------------------------
def _hf_beams(model, prompt, width, max_tokens, length_penalty, early_stopping):
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
        length_penalty=length_penalty, early_stopping=early_stopping, output_scores=True,
        return_dict_in_generate=True, pad_token_id=0,
    )
    eos = model.generation_config.eos_token_id
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        seqs.append(row)
    return seqs, out.sequences_scores.tolist()


# THE BEAM RULE: our ranked hypotheses must equal HF's. Where they differ (float32 reductions run
# in another order can reorder near-equal candidates), our best hypothesis must score at least as
# well as HF's best, both scored by HF's rule cum_logprob / len ** length_penalty (tolerance 1e-4).
def _assert_beams_match(ours, hf_seqs, hf_scores, length_penalty):
    mine = [o.token_ids for o in ours.outputs]
    if mine == hf_seqs:
        return
    best = ours.outputs[0]
    score = best.cumulative_logprob / len(best.token_ids) ** length_penalty
    assert score >= hf_scores[0] - 1e-4, (mine, hf_seqs, score, hf_scores)


@pytest.mark.parametrize("width,length_penalty,early_stopping", [
    (4, 1.0, False), (2, 0.5, True), (3, 2.0, "never"), (4, 0.0, False),
])
def test_beam_search_matches_hf_tiny(tiny_model_factory, hf_model_loader, width, length_penalty, early_stopping):
    path = tiny_model_factory("qwen2")
    llm = LLM(model=str(path), num_kv_blocks=256, max_num_seqs=16)
    model = hf_model_loader(path)
    for seed, n_prompt in [(20, 9), (21, 33)]:
        prompt = _ids(n_prompt, seed)
        params = SamplingParams(n=width, use_beam_search=True, temperature=0, max_tokens=10,
                                length_penalty=length_penalty, early_stopping=early_stopping)
        ours = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert len(ours.outputs) == width
        hf_seqs, hf_scores = _hf_beams(model, prompt, width, 10, length_penalty, early_stopping)
        _assert_beams_match(ours, hf_seqs, hf_scores, length_penalty)
    assert llm.kv_cache_usage()["num_in_use"] == 0
    llm.engine.check_integrity()


@pytest.mark.real_model
def test_beam_search_matches_hf_smollm2(smollm2_path, hf_model_loader):
    llm = LLM(model=str(smollm2_path), num_kv_blocks=256)
    tok = llm.get_tokenizer()
    model = hf_model_loader(smollm2_path)
    for text in ["The capital of France is", "def add(a, b):"]:
        prompt = tok(text).input_ids
        ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, use_beam_search=True, temperature=0,
                                                                       max_tokens=12), use_tqdm=False)[0]
        hf_seqs, hf_scores = _hf_beams(model, prompt, 4, 12, 1.0, False)
        _assert_beams_match(ours, hf_seqs, hf_scores, 1.0)
    assert llm.kv_cache_usage()["num_in_use"] == 0


def test_beam_search_memory_is_bounded_and_nothing_leaks(long_llama):
    llm = LLM(model=str(long_llama), num_kv_blocks=400, max_num_batched_tokens=512)
    out = llm.generate({"prompt_token_ids": _ids(500, 30)},
                       SamplingParams(n=4, use_beam_search=True, temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert all(o.cumulative_logprob is not None for o in out.outputs)
    usage = llm.kv_cache_usage()
    assert usage["peak_in_use"] <= _blocks(500) + 4 * (_blocks(32) + 1) + 4, usage
    assert usage["num_in_use"] == 0
    llm.engine.check_integrity()


def test_llm_beam_search_api(llm):
    outs = llm.beam_search([{"prompt_token_ids": _ids(12, 40)}], BeamSearchParams(beam_width=3, max_tokens=6,
                                                                                  ignore_eos=True))
    seqs = outs[0].sequences
    assert len(seqs) == 3
    assert all(s.tokens[:12] == _ids(12, 40) and len(s.tokens) == 18 for s in seqs)
    scores = [s.cum_logprob / 6 for s in seqs]
    assert scores == sorted(scores, reverse=True) and not any(math.isnan(x) for x in scores)
