"""Retention in the engine (engine/retention.py): an agent's context kept across a tool call while other
traffic fills the pool, cache_control breakpoints, the operator's lookup and release, and that retention never
refuses a request."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError

from engine_testlib import random_ids, tiny_llm


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen2")


def _run(llm: LLM, ids, **params):
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **params)
    return llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0]


def _flood(llm: LLM, n: int, seed: int) -> None:
    """One-off requests that together need more blocks than the pool has."""
    for i in range(n):
        _run(llm, random_ids(60, seed + i))
        llm.engine.check_integrity()


def test_a_sessions_context_outlives_later_traffic_lru_would_evict_it_for(tiny):
    llm = tiny_llm(tiny, num_kv_blocks=24)  # 16-token blocks: room for ~6 one-off requests
    history = random_ids(64, 1)
    first = _run(llm, history, prompt_cache_key="agent-1")
    retained = llm.kv_cache_usage()["num_retained"]
    assert retained >= 4  # the prompt's 4 full blocks (and the output's, once full)
    _flood(llm, 12, 100)  # the tool pause: other requests cycle through the pool
    nxt = history + first.outputs[0].token_ids + random_ids(20, 2)
    again = _run(llm, nxt, prompt_cache_key="agent-1")
    assert again.num_cached_tokens >= 64
    # without a key, the same traffic evicts it
    plain = tiny_llm(tiny, num_kv_blocks=24)
    _run(plain, history)
    _flood(plain, 12, 100)
    assert _run(plain, history + random_ids(20, 2)).num_cached_tokens == 0
    llm.engine.check_integrity()
    assert llm.engine.stats()["kv_retained_blocks"] == llm.kv_cache_usage()["num_retained"]


def test_a_new_turn_releases_the_sessions_previous_context_and_keys_are_per_salt(tiny):
    llm = tiny_llm(tiny, num_kv_blocks=64)
    a, b = random_ids(48, 3), random_ids(48, 4)
    _run(llm, a, prompt_cache_key="s")
    policy = llm.engine.scheduler.retention
    assert policy.sessions() == {(None, "s"): 3}
    _run(llm, b, prompt_cache_key="s")  # another context under the same key: the first is released
    assert policy.sessions() == {(None, "s"): 3}
    assert llm.engine.cache_lookup(a)["retained_tokens"] == 0 and llm.engine.cache_lookup(b)["retained_tokens"] == 48
    _run(llm, a, prompt_cache_key="s", )
    llm.generate({"prompt_token_ids": a}, SamplingParams(max_tokens=2, prompt_cache_key="s"), use_tqdm=False,
                 cache_salt="tenant")
    assert set(policy.sessions()) == {(None, "s"), ("tenant", "s")}
    llm.engine.check_integrity()


def test_breakpoints_retain_the_prefix_up_to_each_and_count_what_they_created(tiny):
    llm = tiny_llm(tiny, num_kv_blocks=64)
    system = random_ids(40, 5)
    out = _run(llm, system + random_ids(30, 6), cache_breakpoints=((40, 300.0),))
    assert out.num_retained_tokens == 32  # the 2 whole blocks within the first 40 tokens
    assert llm.engine.cache_lookup(system)["retained_tokens"] == 32
    again = _run(llm, system + random_ids(30, 7), cache_breakpoints=((40, 300.0),))
    assert again.num_cached_tokens >= 32 and again.num_retained_tokens == 0  # read, not created
    assert llm.engine.cache_release(system) == 32
    assert llm.engine.cache_lookup(system) == {"device_tokens": 32, "retained_tokens": 0, "host_tokens": 0,
                                               "remote_tokens": None}  # None: no Redis tier


def test_retention_never_refuses_a_request(tiny):
    llm = tiny_llm(tiny, num_kv_blocks=12, kv_retention_max_fraction=1.0)
    for i in range(3):
        _run(llm, random_ids(60, 10 + i), prompt_cache_key=f"k{i}", prompt_cache_retention="24h")
    assert llm.kv_cache_usage()["num_retained"] > 6
    out = _run(llm, random_ids(150, 20))  # needs 10 of the 12 blocks: retained ones give way
    assert len(out.outputs[0].token_ids) == 4
    assert llm.engine.stats()["kv_retained_evicted"] > 0
    llm.engine.check_integrity()


def test_the_retention_cap_and_bad_values(tiny):
    llm = tiny_llm(tiny, num_kv_blocks=40, kv_retention_max_fraction=0.25)
    for i in range(4):
        _run(llm, random_ids(64, 30 + i), prompt_cache_key=f"k{i}")
        assert llm.kv_cache_usage()["num_retained"] <= 10
    assert llm.engine.stats()["kv_retention_expired"] > 0
    with pytest.raises(InvalidRequestError, match="prompt_cache_retention"):
        SamplingParams(prompt_cache_key="k", prompt_cache_retention="forever")
    with pytest.raises(InvalidRequestError, match="cache_breakpoints"):
        SamplingParams(cache_breakpoints=((0, 5.0),))
    with pytest.raises(InvalidRequestError, match="prompt_cache_key"):
        SamplingParams(prompt_cache_key="")


def test_llm_warms_a_prefix_and_the_operator_calls_see_it(tiny):
    llm = tiny_llm(tiny, num_kv_blocks=64)
    system = random_ids(50, 40)
    assert llm.retain_prefix(system, 60.0) == 48
    assert llm.cache_lookup(system) == {"device_tokens": 48, "retained_tokens": 48, "host_tokens": 0,
                                        "remote_tokens": None}
    assert _run(llm, system + random_ids(10, 41)).num_cached_tokens >= 48
    assert llm.cache_release(system) == 48 and llm.cache_lookup(system)["retained_tokens"] == 0
    llm.engine.check_integrity()
