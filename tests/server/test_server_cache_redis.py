"""A server with a Redis KV tier (a private redis-server): `prompt_cache_retention: "24h"` keeps the session in
Redis for a day, written by the idle engine loop where Redis lacked a block, and `POST /v1/cache/lookup` reports
`remote_tokens`, null (never a 5xx) once Redis is down."""
from __future__ import annotations

import httpx
import openai
import pytest
import redis

from app.server import create_app
from fixtures.redis_servers import RedisServer
from server_testlib import TINY_MAX_MODEL_LEN, run_uvicorn, shutdown_engine, wait_for_idle, wait_until

SYSTEM = "You are a careful assistant for a hardware store. Answer briefly and politely. " * 12
HEADERS = {"Authorization": "Bearer sk-test"}
DAY_MS = 24 * 3600 * 1000


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def engine(tiny_path, redis_server):
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_path), num_kv_blocks=128, block_size=16, max_model_len=TINY_MAX_MODEL_LEN, max_num_seqs=8,
        kv_redis_url=redis_server.url, kv_redis_ttl=60, kv_redis_timeout=0.1,
    ))
    engine.start()
    yield engine
    shutdown_engine(engine)


@pytest.fixture(scope="module")
def base_url(engine):
    with run_uvicorn(create_app(engine, served_model_names=["tiny"], api_key="sk-test")) as url:
        yield url


def _lookup(base_url, **body) -> dict:
    r = httpx.post(f"{base_url}/v1/cache/lookup", json=body, headers=HEADERS, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_24h_session_lives_in_redis_and_the_lookup_reports_it(base_url, engine, redis_server):
    client = redis.Redis(port=redis_server.port)
    ids = engine.tokenize(SYSTEM)[:100]  # 6 full blocks
    r = httpx.post(f"{base_url}/v1/completions", headers=HEADERS, timeout=60,
                   json={"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    wait_for_idle(engine)
    store, blocks = engine.engine.tiers.remote, engine.engine.blocks
    names = [store.key_for(k) for k in blocks.block_keys(ids)]
    assert wait_until(lambda: all(client.exists(n) for n in names))  # written through, with kv_redis_ttl
    client.delete(names[2], names[4])  # lost by Redis since

    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0)
    out = oai.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0,
                                 extra_body={"prompt_cache_key": "agent", "prompt_cache_retention": "24h"})
    assert out.usage.prompt_tokens_details.cached_tokens == 96
    # no further request: the idle engine loop writes the blocks Redis lacked, the others get their expiry extended
    assert wait_until(lambda: all(client.pttl(n) > DAY_MS - 60_000 for n in names), 10.0), \
        [client.pttl(n) for n in names]
    found = _lookup(base_url, prompt_token_ids=ids)
    assert found == {"prompt_tokens": 100, "device_tokens": 96, "retained_tokens": 96, "host_tokens": 0,
                     "remote_tokens": 0}  # the device holds the prefix: nothing beyond it in Redis
    r = httpx.post(f"{base_url}/reset_prefix_cache", headers=HEADERS)
    assert r.status_code == 200, r.text
    found = _lookup(base_url, prompt_token_ids=ids)
    assert (found["device_tokens"], found["remote_tokens"]) == (0, 96)  # a restarted replica's view
    stats = engine.stats()
    assert stats["kv_redis_retained_writes"] == 2 and stats["kv_redis_retained_extended"] == 4
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'prefixserve:kv_redis_retained_writes_total{model_name="tiny"} 2.0' in metrics

    redis_server.kill()  # Redis down: the lookup still answers, without the remote count
    found = _lookup(base_url, prompt_token_ids=ids)
    assert found["remote_tokens"] is None and found["prompt_tokens"] == 100
    r = httpx.post(f"{base_url}/v1/cache/retain", json={"prompt_token_ids": ids, "ttl": 7200}, headers=HEADERS,
                   timeout=60)
    assert r.status_code == 200 and r.json()["retained_tokens"] == 96
