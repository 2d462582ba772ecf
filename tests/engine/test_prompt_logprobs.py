"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF, chunked, with the prefix cache and
after preemption: every prompt token scored exactly once, with the same values however its KV came."""
from __future__ import annotations


import pytest
import torch

from engine import SamplingParams

from engine_testlib import random_ids, run_checked, tiny_llm

TOL = 1e-4  # float32


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen2")


def _scored(llm, prompt, k=2, **params):
    params = SamplingParams(temperature=0, max_tokens=params.pop("max_tokens", 2), prompt_logprobs=k, **params)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]


def _chosen(out) -> list[float]:
    """The logprob of each prompt token after the first."""
    return [entry[tid].logprob for tid, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def _hf_chosen(model, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return [float(logprobs[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]


def test_chunked_prompt_logprobs_match_hf(tiny, hf_model_loader):
    llm = tiny_llm(tiny)
    prompt = random_ids(100, 1)  # two chunks of 64 tokens
    out = _scored(llm, prompt, k=3)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 100
    assert _chosen(out) == pytest.approx(_hf_chosen(hf_model_loader(tiny), prompt), abs=TOL)
    for tid, entry in zip(prompt[1:], out.prompt_logprobs[1:]):
        ranked = sorted((lp.rank, lp.logprob) for lp in entry.values())
        assert [r for r, _ in ranked][:3] == [1, 2, 3]  # the top 3, plus the prompt token where it is not among them
        assert entry[tid].rank >= 1 and len(entry) in (3, 4)


def test_cached_prefix_is_scored_again_and_still_served(tiny):
    llm = tiny_llm(tiny)
    prompt = random_ids(70, 2)
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2),
                         use_tqdm=False)[0]
    assert plain.num_cached_tokens == 0  # the prompt's 4 full blocks are cached now
    first = _scored(llm, prompt)
    # Every prompt token needs the logits of the position before it: nothing can come from the cache.
    assert first.num_cached_tokens == 0
    again = _scored(llm, prompt)
    assert again.num_cached_tokens == 0
    assert again.prompt_logprobs == first.prompt_logprobs
    off = _scored(tiny_llm(tiny, enable_prefix_caching=False), prompt)
    assert _chosen(first) == pytest.approx(_chosen(off), abs=TOL)
    # A request that does not ask for prompt logprobs still hits the blocks.
    before = llm.engine.stats()["prefix_cache_hits"]
    served = llm.generate({"prompt_token_ids": prompt + random_ids(5, 3)}, SamplingParams(temperature=0, max_tokens=2),
                          use_tqdm=False)[0]
    assert served.num_cached_tokens == 64
    assert llm.engine.stats()["prefix_cache_hits"] - before == 64
    llm.engine.check_integrity()


def test_preempted_request_scores_every_prompt_token_once(tiny):
    prompts = [random_ids(30 + i, 10 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    roomy = tiny_llm(tiny, block_size=8).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tight = tiny_llm(tiny, block_size=8, num_kv_blocks=12, max_num_seqs=6)  # cannot hold all six: preemption
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, roomy):
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert _chosen(out) == pytest.approx(_chosen(ref), abs=TOL)
    assert tight.kv_cache_usage()["num_in_use"] == 0
    tight.engine.check_integrity()


def test_n_samples_share_one_prompt_scoring(tiny):
    llm = tiny_llm(tiny)
    prompt = random_ids(40, 4)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=0))
    out = run_checked(engine)["r"]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == 40
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])  # k=0: only the prompt token
