"""Long retention written through to Redis (engine/retention.py, KVTiers.persist) and Redis in the operator's
lookup: a 24-hour session, or a breakpoint / warm-up longer than --prompt-cache-ttl, keeps its blocks in Redis at
least that long, so a replica that restarts (a fresh engine on the same Redis) finds the context there.

Real parts: a tiny random model, the shared Redis at 127.0.0.1:6379 under a unique key prefix per test, a private
redis-server that is killed. Block and tier integrity is checked after every step (run_checked)."""
from __future__ import annotations

import time

import pytest
import redis

from engine import LLM, SamplingParams
from fixtures.redis_servers import SHARED_URL, RedisServer, unique_prefix
from prefix_cache.kv_codec import decode_block

from engine_testlib import random_ids, run_checked

DAY_MS = 24 * 3600 * 1000
SHORT_TTL = 60  # kv_redis_ttl of these engines: what an ordinary write-through gets


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def client():
    c = redis.Redis.from_url(SHARED_URL)
    yield c
    c.close()


def _llm(path, prefix: str, **kw) -> LLM:
    args = dict(block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                kv_redis_url=SHARED_URL, kv_redis_key_prefix=prefix, kv_redis_ttl=SHORT_TTL)
    args.update(kw)
    return LLM(model=str(path), **args)


def _run(llm: LLM, ids: list[int], *, cache_salt: str | None = None, max_tokens: int = 12, **params):
    engine = llm.engine
    rid = f"q{time.monotonic_ns()}"
    engine.add_request(rid, {"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params),
                       cache_salt=cache_salt)
    return run_checked(engine)[rid]


def _pttl(llm: LLM, client, token_ids: list[int], cache_salt: str | None = None) -> list[int]:
    """Milliseconds each full block of ``token_ids`` has left in Redis (-2: absent)."""
    store = llm.engine.tiers.remote
    return [client.pttl(store.key_for(k)) for k in llm.engine.blocks.block_keys(token_ids, cache_salt=cache_salt)]


def _context(out) -> list[int]:
    """The tokens with KV at the request's end: the prompt and every output token but the last."""
    return out.prompt_token_ids + out.outputs[0].token_ids[:-1]


def test_a_24h_session_is_kept_in_redis_and_a_restarted_replica_finds_it(tiny, prefix, client):
    history = random_ids(70, 1)
    a = _llm(tiny, prefix)
    first = _run(a, history, prompt_cache_key="agent", prompt_cache_retention="24h")
    context = _context(first)  # 81 tokens: 5 full blocks, the last of them holding output tokens
    assert a.engine.flush_kv_writes()
    left = _pttl(a, client, context)
    assert len(left) == 5 and all(ms > DAY_MS - 60_000 for ms in left), left  # not kv_redis_ttl's 60 s
    stats = a.engine.stats()
    assert stats["kv_redis_retained_extended"] == 5 and stats["kv_redis_retained_lost"] == 0
    assert stats["kv_redis_retained_writes"] == 0  # every block was already written through: extended only
    a.engine.check_integrity()
    turn2 = context + first.outputs[0].token_ids[-1:] + random_ids(9, 2)
    reference = _run(_llm(tiny, prefix, kv_redis_url=None), turn2)
    a.engine.close()

    b = _llm(tiny, prefix)  # the replica restarted: nothing on its device, the session in Redis
    assert b.cache_lookup(context) == {"device_tokens": 0, "retained_tokens": 0, "host_tokens": 0,
                                       "remote_tokens": 80}
    assert b.cache_lookup(turn2)["remote_tokens"] == 80
    again = _run(b, turn2, prompt_cache_key="agent", prompt_cache_retention="24h")
    assert again.num_cached_tokens == 80 and b.engine.stats()["kv_redis_hits"] == 5
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids
    assert b.cache_lookup(turn2)["device_tokens"] >= 80
    b.engine.check_integrity()
    b.engine.close()


def test_only_retentions_longer_than_the_prompt_cache_ttl_are_kept_in_redis(tiny, prefix, client):
    llm = _llm(tiny, prefix)
    session = random_ids(50, 3)
    out = _run(llm, session, prompt_cache_key="s")  # the default retention: prompt_cache_ttl (300 s)
    system, question = random_ids(40, 4), random_ids(30, 5)
    _run(llm, system + question, cache_breakpoints=((40, 3600.0),))  # Anthropic's "1h" after the system prompt
    five_min = random_ids(40, 6)
    _run(llm, five_min, cache_breakpoints=((40, 300.0),))  # "5m": not beyond the engine's own TTL
    assert llm.engine.flush_kv_writes()
    assert all(0 < ms <= SHORT_TTL * 1000 for ms in _pttl(llm, client, _context(out)))
    assert all(0 < ms <= SHORT_TTL * 1000 for ms in _pttl(llm, client, five_min))
    hour = _pttl(llm, client, system + question)
    assert all(ms > 3600_000 - 60_000 for ms in hour[:2])  # the 2 blocks within the breakpoint
    assert all(0 < ms <= SHORT_TTL * 1000 for ms in hour[2:])  # the rest: an ordinary write-through
    assert llm.engine.stats()["kv_redis_retained_extended"] == 2
    llm.engine.close()


def test_blocks_redis_lacks_are_written_from_the_device_with_the_retentions_expiry(tiny, prefix, client):
    llm = _llm(tiny, prefix)
    prompt = random_ids(66, 7)
    _run(llm, prompt)  # cached and written through with kv_redis_ttl ...
    assert llm.engine.flush_kv_writes()
    store = llm.engine.tiers.remote
    keys = [store.key_for(k) for k in llm.engine.blocks.block_keys(prompt)]
    assert client.delete(*keys[1:3]) == 2  # ... then evicted from Redis (maxmemory, an expiry, a flush)
    out = _run(llm, prompt, max_tokens=2, prompt_cache_key="k", prompt_cache_retention="24h")
    assert out.num_cached_tokens == 64  # device hits: no ordinary write-through of these blocks
    assert llm.engine.flush_kv_writes()
    left = _pttl(llm, client, prompt)
    assert all(ms > DAY_MS - 60_000 for ms in left), left
    stats = llm.engine.stats()
    assert stats["kv_redis_retained_writes"] == 2 and stats["kv_redis_retained_extended"] == 2
    llm.engine.check_integrity()
    fresh = _llm(tiny, prefix)  # and what was written decodes as the right blocks
    assert fresh.cache_lookup(prompt)["remote_tokens"] == 64
    assert _run(fresh, prompt, max_tokens=2).num_cached_tokens == 64 and fresh.engine.stats()["kv_redis_hits"] == 4
    fresh.engine.close()

    # absent from Redis and evicted from the device before the writer said so: counted, nothing else happens
    other = random_ids(40, 8)
    _run(llm, other)
    assert llm.engine.flush_kv_writes()
    client.delete(*[store.key_for(k) for k in llm.engine.blocks.block_keys(other)])
    _run(llm, other, max_tokens=2, prompt_cache_key="k2", prompt_cache_retention="24h")
    llm.engine.tiers.flush(5.0)  # the writer has reported the absent blocks ...
    llm.engine.blocks.evict(llm.engine.blocks.num_blocks)  # ... which the device no longer holds
    llm.engine.check_integrity()
    assert llm.engine.flush_kv_writes()
    assert llm.engine.stats()["kv_redis_retained_lost"] == 2
    assert _pttl(llm, client, other) == [-2, -2]
    llm.engine.close()


def test_a_later_ordinary_write_never_shortens_a_retained_entry(tiny, prefix, client):
    a = _llm(tiny, prefix)
    prompt = random_ids(50, 9)
    _run(a, prompt, max_tokens=2, cache_breakpoints=((50, 7200.0),))
    assert a.engine.flush_kv_writes()
    a.engine.close()
    b = _llm(tiny, prefix)  # another replica computes the same blocks (declining to load them) and writes them
    b.engine.tiers.costs.worth_loading = lambda tier: False
    out = _run(b, prompt, max_tokens=2)
    assert out.num_cached_tokens == 0
    assert b.engine.flush_kv_writes() and b.engine.stats()["kv_redis_writes"] == 3
    assert all(ms > 7200_000 - 60_000 for ms in _pttl(b, client, prompt))  # still the retention's 2 hours
    b.engine.close()


def test_keys_are_per_cache_salt(tiny, prefix):
    a = _llm(tiny, prefix)
    ids = random_ids(40, 10)
    _run(a, ids, cache_salt="tenant-1", prompt_cache_key="s", prompt_cache_retention="24h")
    assert a.engine.flush_kv_writes()
    a.engine.close()
    b = _llm(tiny, prefix)
    assert b.engine.cache_lookup(ids, cache_salt="tenant-1")["remote_tokens"] == 32
    assert b.engine.cache_lookup(ids)["remote_tokens"] == 0
    assert b.engine.cache_lookup(ids, cache_salt="tenant-2")["remote_tokens"] == 0
    b.engine.close()


def test_only_full_verified_blocks_reach_redis_under_speculative_decoding(tiny_model_factory, prefix, client):
    # every offered draft is verified (tests/conftest.py), so drafts are accepted and rejected alike anywhere
    copying = tiny_model_factory("llama", tie_word_embeddings=True, init_std=0.1)  # repeats its context
    llm = _llm(copying, prefix, num_kv_blocks=128, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    texts = ["one two three four five six seven eight nine ten " * 6, "abc def ghi " * 10 + "abc",
             "The list: red, green, blue, red, green, blue, red, green"]
    engine = llm.engine
    for i, text in enumerate(texts):
        engine.add_request(f"r{i}", text, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                                         prompt_cache_key=f"s{i}", prompt_cache_retention="24h"))
    finals = run_checked(engine)
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # some rejected
    assert engine.flush_kv_writes()
    store = engine.tiers.remote
    contexts = [_context(finals[f"r{i}"]) for i in range(len(texts))]
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    # whole blocks of verified tokens only: no partial block, no block holding a rejected draft
    assert len(keys) == sum(len(c) // 16 for c in contexts)
    for context in contexts:
        for i, key in enumerate(engine.blocks.block_keys(context)):
            block = decode_block(client.get(store.key_for(key)), store.layout, key)
            assert block.meta.token_ids == tuple(context[i * 16:(i + 1) * 16])
            assert client.pttl(store.key_for(key)) > DAY_MS - 60_000
    assert engine.stats()["kv_redis_retained_extended"] == len(keys)
    engine.close()


def test_redis_down_the_lookup_still_answers_and_retention_still_works(tiny):
    server = RedisServer().start()
    try:
        llm = _llm(tiny, unique_prefix(), kv_redis_url=server.url, kv_redis_timeout=0.1)
        ids = random_ids(40, 11)
        _run(llm, ids, prompt_cache_key="s", prompt_cache_retention="24h")
        assert llm.engine.flush_kv_writes()
        assert llm.cache_lookup(ids + random_ids(40, 12))["remote_tokens"] == 0  # beyond the device: absent
        server.kill()
        start = time.monotonic()
        found = llm.cache_lookup(ids + random_ids(40, 12))
        assert time.monotonic() - start < 1.0
        assert found["remote_tokens"] is None and found["device_tokens"] == 32
        out = _run(llm, ids + random_ids(20, 13), prompt_cache_key="s", prompt_cache_retention="24h")
        assert out.num_cached_tokens >= 32 and len(out.outputs[0].token_ids) == 12  # device hits (a partial too)
        llm.engine.flush_kv_writes(3.0)  # the writer waits out the breaker's backoff, then fails
        assert llm.engine.stats()["kv_redis_retained_lost"] > 0  # the retention could not reach Redis
        llm.engine.check_integrity()
        llm.engine.close(timeout=0.5)
    finally:
        server.kill()
