"""The prefix cache inside the engine: hits, partial blocks, tenants, and unchanged outputs."""
from __future__ import annotations


import pytest

from engine import LLM, SamplingParams

from engine_testlib import assert_greedy_match, hf_greedy, random_ids, run_checked, tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen2")


def _run(llm, prompt_ids, params=GREEDY, **kw):
    return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False, **kw)[0]


@pytest.mark.parametrize("shared", [16, 32, 37, 45, 63])
def test_shared_prefix_hit_including_partial_block(tiny, hf_model_loader, shared):
    llm = tiny_llm(tiny)
    system = random_ids(64, 1)
    first = system + random_ids(20, 2)
    second = system[:shared] + random_ids(30, 3)
    _run(llm, first)
    out = _run(llm, second)
    # Full blocks and the partial block by copy-on-write: every shared token is reused.
    assert out.num_cached_tokens == shared
    ref = hf_greedy(hf_model_loader(tiny), [second], 8)[0]
    assert_greedy_match(out.outputs[0].token_ids, ref, f"shared={shared}")
    assert llm.kv_cache_usage()["num_in_use"] == 0
    llm.engine.check_integrity()


def test_whole_prompt_cached_still_recomputes_last_token(tiny):
    llm = tiny_llm(tiny)
    prompt = random_ids(48, 4)  # exactly 3 blocks
    a = _run(llm, prompt)
    b = _run(llm, prompt)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 47
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_cache_off_never_hits(tiny):
    llm = tiny_llm(tiny, enable_prefix_caching=False)
    prompt = random_ids(48, 5)
    _run(llm, prompt)
    assert _run(llm, prompt).num_cached_tokens == 0
    assert llm.engine.stats()["prefix_cache_hits"] == 0


def test_cache_salt_keeps_tenants_apart(tiny):
    llm = tiny_llm(tiny)
    prompt = random_ids(48, 6)  # block-aligned: every prompt block is full, hence cached
    _run(llm, prompt, cache_salt="tenant-a")
    assert _run(llm, prompt, cache_salt="tenant-b").num_cached_tokens == 0
    assert _run(llm, prompt, cache_salt="tenant-a").num_cached_tokens == 47
    assert _run(llm, prompt).num_cached_tokens == 0  # no salt is its own tenant


def test_blocks_shareable_while_the_first_request_still_runs(tiny):
    llm = tiny_llm(tiny, max_num_batched_tokens=32)
    engine = llm.engine
    system = random_ids(96, 7)
    engine.add_request("a", {"prompt_token_ids": system + random_ids(4, 8)}, GREEDY)
    engine.step()
    engine.step()  # a has computed 64 tokens = 4 full blocks, still prefilling
    engine.add_request("b", {"prompt_token_ids": system[:70] + random_ids(5, 9)}, GREEDY)
    finals = run_checked(engine)
    assert finals["b"].num_cached_tokens >= 64


def test_stats_count_queries_and_hits(tiny):
    llm = tiny_llm(tiny)
    prompt = random_ids(64, 10)
    _run(llm, prompt)
    _run(llm, prompt[:40] + random_ids(8, 11))
    stats = llm.engine.stats()
    assert stats["prefix_cache_queries"] == 64 + 48
    assert stats["prefix_cache_hits"] == 40


def test_eviction_under_pressure_keeps_outputs_right(tiny, hf_model_loader):
    # 12 blocks: older cached prefixes must be evicted to admit new prompts.
    llm = tiny_llm(tiny, num_kv_blocks=12)
    prompts = [random_ids(50, 20 + i) for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    again = _run(llm, prompts[-1])
    assert again.num_cached_tokens > 0
    assert llm.engine.stats()["prefix_cache_evictions"] > 0
    refs = hf_greedy(hf_model_loader(tiny), prompts, 8)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert_greedy_match(o.outputs[0].token_ids, r, f"prompt {i}")
    assert again.outputs[0].token_ids == outs[-1].outputs[0].token_ids
    llm.engine.check_integrity()


@pytest.mark.real_model
def test_smollm2_greedy_same_with_cache_on_and_off(smollm2_path, hf_model_loader):
    tok_llm = LLM(model=str(smollm2_path), num_kv_blocks=256, max_num_batched_tokens=256)
    tok = tok_llm.get_tokenizer()
    system = tok("You are a careful assistant. Answer briefly and precisely. " * 6).input_ids  # not block aligned
    assert len(system) % 16
    questions = ["What is two plus two?", "Name a color.", "Where is Paris?", "What is water made of?"]
    prompts = [system + tok(q).input_ids for q in questions] + [system[:64] + tok("Say hi.").input_ids]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    on = tok_llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm the cache
    on += tok_llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 64 for o in on[1:])
    off_llm = LLM(model=str(smollm2_path), num_kv_blocks=256, max_num_batched_tokens=256, enable_prefix_caching=False)
    off = off_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    refs = hf_greedy(hf_model_loader(smollm2_path), prompts, 12)
    for i, (a, b, r) in enumerate(zip(on, off, refs)):
        assert_greedy_match(a.outputs[0].token_ids, r, f"cache on, prompt {i}")
        assert_greedy_match(b.outputs[0].token_ids, r, f"cache off, prompt {i}")
    assert tok_llm.kv_cache_usage()["num_in_use"] == 0


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny, hf_model_loader):
    llm = tiny_llm(tiny, max_num_batched_tokens=256, max_num_seqs=8)
    system = random_ids(64, 30)
    prompts = [system + random_ids(8, 31 + i) for i in range(8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    # The first computes the 64-token prefix; the other seven wait one step and hit all of it.
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [64] * 7
    refs = hf_greedy(hf_model_loader(tiny), prompts, 8)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert_greedy_match(o.outputs[0].token_ids, r, f"prompt {i}")
    llm.engine.check_integrity()
