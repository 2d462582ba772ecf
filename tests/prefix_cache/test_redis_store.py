"""RedisKVStore against real Redis: the shared server (unique key prefix per test, cleaned up) and
private redis-server processes that are killed, paused (a hung server) and restarted."""
from __future__ import annotations

import time

import pytest
import redis

from fixtures.redis_servers import SHARED_URL, RedisServer, delete_prefix, unique_prefix
from prefix_cache.hashing import block_key
from prefix_cache.kv_codec import BlockMeta, KVLayout, digest, encode_block
from prefix_cache.redis_store import CircuitBreaker, RedisKVStore, layout_namespace

SHAPE = (2, 2, 4, 1, 2)  # 128 bytes of float32


@pytest.fixture
def prefix():
    p = unique_prefix()
    yield p
    delete_prefix(SHARED_URL, p)


def _layout(prefix: str) -> KVLayout:
    return KVLayout(layout_namespace(prefix, "fp0123", "float32", 4), "float32", SHAPE)


def _chain(n: int, seed: int = 0) -> list[BlockMeta]:
    metas, parent = [], None
    for i in range(n):
        tokens = tuple(range(seed + 4 * i, seed + 4 * i + 4))
        key = block_key(parent, tokens)
        metas.append(BlockMeta(key, parent, tokens, digest(b"ns")))
        parent = key
    return metas


def _payload(i: int) -> bytes:
    return bytes([i % 256]) * 128


def test_keys_are_namespaced():
    layout = _layout("pfx")
    store = RedisKVStore(SHARED_URL, layout)
    key = block_key(None, [1, 2, 3, 4])
    assert store.key_for(key) == f"pfx:kv:v1:fp0123:float32:bs4:tp0of1:{key.hex()}"
    with pytest.raises(ValueError):
        layout_namespace("pfx", "fp", "float32", 4, tp_rank=2, tp_size=2)
    store.close()


def test_write_then_fetch_stops_at_the_first_miss(prefix):
    store = RedisKVStore(SHARED_URL, _layout(prefix), ttl=60)
    metas = _chain(5)
    for i in (0, 1, 2, 4):  # block 3 is missing
        assert store.put(metas[i], _payload(i))
    assert store.flush(5)
    found = store.fetch_prefix([m.key for m in metas])
    assert [bytes(b.payload) for b in found] == [_payload(i) for i in range(3)]
    assert [b.meta for b in found] == metas[:3]
    client = redis.Redis.from_url(SHARED_URL)
    assert 0 < client.ttl(store.key_for(metas[0].key)) <= 60
    assert store.stats()["writes"] == 4 and store.stats()["failures"] == 0
    store.close()
    assert not store.put(metas[3], _payload(3))  # closed: dropped, counted
    assert store.stats()["dropped_writes"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_bad_values_are_ignored_and_counted(prefix, damage):
    store = RedisKVStore(SHARED_URL, _layout(prefix))
    metas = _chain(3, seed=10)
    for i, m in enumerate(metas):
        store.put(m, _payload(i))
    store.flush(5)
    client = redis.Redis.from_url(SHARED_URL)
    name = store.key_for(metas[1].key)
    value = client.get(name)
    if damage == "flip":
        client.setrange(name, len(value) - 5, bytes([value[-5] ^ 0xFF]))
    elif damage == "truncate":
        client.set(name, value[:-7])
    else:  # another model's value for the same block key, copied under this key
        client.set(name, encode_block(_layout(prefix + "x"), metas[1], _payload(1)))
    found = store.fetch_prefix([m.key for m in metas])
    assert len(found) == 1  # block 0; block 1 is bad, so nothing after it is used
    assert store.stats()["corrupt_values"] == 1
    store.close()


def test_full_queue_drops_writes_and_counts_them():
    server = RedisServer().start()
    layout = _layout("q")
    store = RedisKVStore(server.url, layout, timeout=0.1, max_pending_bytes=2 * layout.nbytes)
    server.kill()  # writes fail, the breaker opens, the writer waits and its queue fills up
    accepted = [store.put(m, _payload(0)) for m in _chain(20)]
    time.sleep(0.3)
    accepted += [store.put(m, _payload(0)) for m in _chain(20, seed=1000)]
    stats = store.stats()
    assert accepted.count(False) >= 30 and stats["dropped_writes"] >= 30
    store.close(timeout=0.2)


def test_down_hung_and_restarted_server():
    server = RedisServer().start()
    store = RedisKVStore(server.url, _layout("f"), timeout=0.2)
    metas = _chain(3, seed=50)
    for i, m in enumerate(metas):
        store.put(m, _payload(i))
    assert store.flush(5)
    keys = [m.key for m in metas]
    assert len(store.fetch_prefix(keys)) == 3
    try:
        # down: connection refused, counted; then the breaker answers at once
        server.kill()
        assert store.fetch_prefix(keys) == []
        assert store.stats()["failures"] == 1 and not store.available
        start = time.monotonic()
        assert store.fetch_prefix(keys) == []
        assert time.monotonic() - start < 0.05
        # back (empty, no persistence): after the backoff the store reconnects by itself
        server.start()
        deadline = time.monotonic() + 5
        while not store.available and time.monotonic() < deadline:
            store.fetch_prefix(keys)
            time.sleep(0.05)
        assert store.available
        assert store.put(metas[0], _payload(0)) and store.flush(5)
        assert len(store.fetch_prefix(keys)) == 1
        # hung (SIGSTOP): a read costs at most about one timeout, then the breaker opens
        server.pause()
        start = time.monotonic()
        assert store.fetch_prefix(keys) == []
        assert time.monotonic() - start < 1.0
        start = time.monotonic()
        assert store.fetch_prefix(keys) == []
        assert time.monotonic() - start < 0.05
        server.resume()
    finally:
        server.kill()
        store.close(timeout=0.2)


def test_circuit_breaker_backoff():
    now = [0.0]
    breaker = CircuitBreaker(base=1.0, cap=4.0, clock=lambda: now[0])
    assert breaker.allow()
    breaker.failure()
    assert not breaker.allow()
    now[0] = 1.0
    assert breaker.allow()  # half-open: one probe ...
    assert not breaker.allow()  # ... and only one
    breaker.failure()  # the probe failed: 2 s now
    now[0] = 2.5
    assert not breaker.allow()
    now[0] = 3.0
    assert breaker.allow()
    breaker.success()
    assert breaker.allow() and not breaker.is_open
