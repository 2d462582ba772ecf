"""RedisKVStore against real Redis: the shared server (unique key prefix per test, cleaned up) and
private redis-server processes that are killed, paused (a hung server) and restarted."""
from __future__ import annotations

import time

import pytest
import redis

from fixtures.redis_servers import SHARED_URL, RedisServer
from prefix_cache.hashing import block_key
from prefix_cache.kv_codec import BlockMeta, KVLayout, digest, encode_block
from prefix_cache.redis_store import CircuitBreaker, RedisKVStore, layout_namespace

SHAPE = (2, 2, 4, 1, 2)  # 128 bytes of float32


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
        # writes while it is down are dropped at once (counted), not queued: an outage holds no block bytes
        dropped = store.stats()["dropped_writes"]
        assert not any(store.put(m, _payload(0)) for m in _chain(50, seed=7))
        assert store.stats()["pending_writes"] == 0 and store.stats()["dropped_writes"] == dropped + 50
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


# -- expiry, long retention and the lookup's probe ----------------------------------------------------
def test_a_write_never_shortens_an_entrys_expiry(prefix):
    client = redis.Redis.from_url(SHARED_URL)
    store = RedisKVStore(SHARED_URL, _layout(prefix), ttl=60)
    a, b = _chain(2, seed=200)
    assert store.put(a, _payload(1), ttl_s=7200) and store.flush(5)  # a long retention's block
    assert client.pttl(store.key_for(a.key)) > 7100_000
    assert store.put(a, _payload(2)) and store.flush(5)  # recomputed elsewhere and written again: still 2 h
    assert client.pttl(store.key_for(a.key)) > 7100_000
    assert [bytes(x.payload) for x in store.fetch_prefix([a.key])] == [_payload(2)]  # the value was replaced
    client.set(store.key_for(b.key), b"stale", px=5000)  # an entry about to expire gets the store's ttl again
    assert store.put(b, _payload(3)) and store.flush(5)
    assert 50_000 < client.pttl(store.key_for(b.key)) <= 60_000
    assert store.stats()["retained_writes"] == 1 and store.stats()["writes"] == 3
    store.close()
    forever = RedisKVStore(SHARED_URL, _layout(prefix))  # ttl None: entries without expiry keep none
    assert forever.put(b, _payload(4), ttl_s=60) and forever.flush(5)
    assert client.pttl(forever.key_for(b.key)) == -1
    forever.close()


def test_retain_extends_present_entries_and_reports_absent_ones(prefix):
    client = redis.Redis.from_url(SHARED_URL)
    store = RedisKVStore(SHARED_URL, _layout(prefix), ttl=60)
    metas = _chain(4, seed=300)
    for i in (0, 1, 3):  # block 2 absent
        store.put(metas[i], _payload(i))
    store.put(metas[3], _payload(3), ttl_s=90_000)  # already retained longer than asked below
    assert store.retain([m.key for m in metas], 3600) and store.flush(5)
    left = [client.pttl(store.key_for(m.key)) for m in metas]
    assert 3590_000 < left[0] <= 3600_000 and 3590_000 < left[1] <= 3600_000
    assert left[2] == -2 and left[3] > 89_000_000  # never written, and never shortened
    assert store.take_missing() == [(metas[2].key, 3600.0)] and store.take_missing() == []
    assert not store.has_missing
    stats = store.stats()
    assert (stats["retained_extended"], stats["retained_missing"]) == (3, 1)
    assert store.retain([], 10)  # nothing to do
    store.close()
    assert not store.retain([metas[0].key], 10) and store.stats()["dropped_retains"] == 1


def test_count_prefix_probes_existence_and_says_none_when_redis_does_not_answer():
    server = RedisServer().start()
    store = RedisKVStore(server.url, _layout("c"), timeout=0.1)
    try:
        metas = _chain(4, seed=400)
        for i in (0, 1, 3):
            store.put(metas[i], _payload(i))
        assert store.flush(5)
        keys = [m.key for m in metas]
        assert store.count_prefix(keys) == 2 and store.count_prefix(keys[3:]) == 1 and store.count_prefix([]) == 0
        server.pause()  # hung: one timeout, then the breaker answers at once
        start = time.monotonic()
        assert store.count_prefix(keys) is None
        assert time.monotonic() - start < 1.0
        start = time.monotonic()
        assert store.count_prefix(keys) is None and time.monotonic() - start < 0.05
        server.resume()
    finally:
        server.kill()
        store.close(timeout=0.2)
    assert store.count_prefix(keys) is None  # closed


def test_a_server_refusing_scripts_gets_plain_commands():
    server = RedisServer().start()
    try:
        admin = redis.Redis(port=server.port)
        admin.acl_setuser("noscripts", enabled=True, nopass=True, keys=["*"], commands=["+@all", "-@scripting"])
        url = f"redis://noscripts:x@127.0.0.1:{server.port}/0"
        store = RedisKVStore(url, _layout("s"), ttl=60, timeout=0.5)
        metas = _chain(3, seed=500)
        for i in (0, 1):
            store.put(metas[i], _payload(i))
        assert store.retain([m.key for m in metas], 3600) and store.flush(5)
        assert len(store.fetch_prefix([m.key for m in metas])) == 2
        assert admin.pttl(store.key_for(metas[0].key)) > 3590_000  # PEXPIRE: extended all the same
        assert store.take_missing() == [(metas[2].key, 3600.0)]
        stats = store.stats()
        assert stats["writes"] == 2 and stats["failures"] == 0 and stats["retained_extended"] == 2
        store.close()
    finally:
        server.kill()


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
