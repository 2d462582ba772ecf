"""RedisKVStore: KV blocks shared through Redis by every replica of one model.

Keys::

    <prefix>:kv:v<format>:<model fingerprint>:<dtype>:bs<block_size>:tp<rank>of<size>:<block key hex>

(``KVLayout.namespace`` is everything before the block key; ``<dtype>`` is the model dtype, followed by
``-float8_e4m3fn`` for an fp8 KV cache, whose values also name float8_e4m3fn as their dtype.)  Values are ``kv_codec`` bytes:
self-describing and checksummed, never pickle.  A value that is corrupt, truncated or foreign is
ignored and counted; the engine then recomputes the block and its write-through replaces it.

Reads (``fetch_prefix``) run on the caller's thread at admission: one pipelined EXISTS for all
candidate keys, then pipelined GETs of the leading run of present keys in chunks, stopping at
the first missing or invalid value.  ``count_prefix`` (the operator's lookup) is the EXISTS half
alone.  Writes (``put``) never block: they enter a bounded queue that one background thread
drains in pipelined batches; a full queue drops the write and counts it.

Expiry.  A write never shortens an entry's life: it sets the value with an expiry of the longer of
the entry's remaining one and its own (``ttl``, or the ``ttl_s`` a long retention passes; none:
no expiry, as an entry without one keeps none), in one server-side script (``WRITE_SCRIPT``), so
a block retained for 24 hours by one replica is not cut back to ``ttl`` when another replica
computes it again.  ``retain(keys, ttl_s)`` (a long retention's blocks) extends present entries'
expiry to at least ``ttl_s`` from now (``EXTEND_SCRIPT``, pipelined; never rewriting a value)
and reports the absent ones through ``take_missing``, so the engine writes them from its device
pool.  A server that refuses scripts (an ACL, a proxy without EVAL) gets plain SET / PEXPIRE
instead (logged once): then a write may shorten an entry's expiry.

Faults: every call has short socket and connect timeouts and redis-py's own retries are off.  A
failure opens a circuit breaker (backoff 0.5 s doubling to 10 s): while it is open, reads return
no hits at once, the writer waits and new writes are dropped (counted) rather than queued.
When the backoff ends one call probes the server -- redis-py reconnects by itself -- and success
closes the breaker.  Redis down, slow or flapping thus costs at most one timeout per backoff
period and never fails a request.

This module imports redis; ``prefix_cache`` itself never imports it (the engine imports this
module only when a Redis URL is configured).
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .hashing import BlockKey
from .kv_codec import FORMAT_VERSION, BlockMeta, DecodedBlock, KVLayout, KVValueError, decode_block, encode_block

logger = logging.getLogger("prefixserve")

FETCH_CHUNK = 16  # GETs per pipeline round trip: bounds one reply's size, stops soon after a bad value
WRITE_BATCH = 32  # queued writes (and retentions) per pipeline round trip
DEFAULT_MAX_PENDING_BYTES = 256 << 20

# KEYS[1] = the entry, ARGV[1] = the value, ARGV[2] = its expiry in ms (0: none). PTTL: -2 absent, -1 no expiry.
WRITE_SCRIPT = """local left = redis.call('PTTL', KEYS[1])
local ttl = tonumber(ARGV[2])
if ttl == 0 or left == -1 then redis.call('SET', KEYS[1], ARGV[1]) return 1 end
if left > ttl then ttl = left end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
return 1"""
# KEYS[1] = the entry, ARGV[1] = the least expiry in ms it must have. 0: absent (nothing done), 1: present.
EXTEND_SCRIPT = """local left = redis.call('PTTL', KEYS[1])
if left == -2 then return 0 end
if left ~= -1 and left < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1"""


@dataclass(frozen=True)
class _Put:
    meta: BlockMeta
    payload: bytes | memoryview
    ttl_ms: int | None  # None: no expiry
    retained: bool = False  # written for a long retention (the block was absent when it was retained)


@dataclass(frozen=True)
class _Retain:
    keys: tuple[BlockKey, ...]
    ttl_s: float


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _scripts_refused(exc: redis.ResponseError) -> bool:
    """The server will not run EVAL at all (an ACL, a proxy without scripting), as opposed to a failing call."""
    text = str(exc).lower()
    return isinstance(exc, redis.exceptions.NoPermissionError) or "unknown command" in text \
        or "noperm" in text or "scripting" in text


def layout_namespace(prefix: str, fingerprint: str, dtype: str, block_size: int, tp_rank: int = 0,
                     tp_size: int = 1) -> str:
    """The key namespace of one model's blocks (see module docstring)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is outside [0, {tp_size})")
    return f"{prefix}:kv:v{FORMAT_VERSION}:{fingerprint}:{dtype}:bs{block_size}:tp{tp_rank}of{tp_size}"


class CircuitBreaker:
    """Closed: calls go through.  After a failure: open for ``backoff`` seconds (doubling up to
    ``cap`` with each further failure); then one caller may probe (half-open) and the next
    ``success`` closes it.  Thread-safe."""

    def __init__(self, base: float = 0.5, cap: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.base, self.cap, self._clock = base, cap, clock
        self._lock = threading.Lock()
        self._open_until: float | None = None
        self._backoff = base

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        with self._lock:
            if self._open_until is None:
                return True
            now = self._clock()
            if now < self._open_until:
                return False
            # half-open: this caller probes; the others keep waiting until it reports
            self._open_until = now + self._backoff
            return True

    def success(self) -> None:
        with self._lock:
            self._open_until = None
            self._backoff = self.base

    def failure(self) -> None:
        with self._lock:
            self._open_until = self._clock() + self._backoff
            self._backoff = min(self.cap, self._backoff * 2)


def _close_at_exit(ref: weakref.ref) -> None:
    store = ref()
    if store is not None:
        store.close(timeout=5.0)


class RedisKVStore:
    """KV blocks of one ``KVLayout`` in Redis (see module docstring).  Thread-safe."""

    def __init__(
        self,
        url: str,
        layout: KVLayout,
        *,
        ttl: int | None = None,
        timeout: float = 0.25,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        if ttl is not None and ttl < 1:
            raise ValueError("ttl must be a positive number of seconds or None")
        self.layout = layout
        self.ttl = ttl
        self.url = url
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._breaker = CircuitBreaker()
        self._prefix = layout.namespace + ":"
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_pending_bytes // layout.nbytes))
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._counts = {"lookups": 0, "fetched_blocks": 0, "writes": 0, "dropped_writes": 0, "failures": 0,
                        "corrupt_values": 0, "retained_writes": 0, "retained_extended": 0, "retained_missing": 0,
                        "dropped_retains": 0}
        self._scripts = True  # False once the server refused EVAL: plain SET / PEXPIRE from then on
        self._missing: collections.deque[tuple[BlockKey, float]] = collections.deque()  # retained, absent here
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    # ---- helpers ---------------------------------------------------------------------------
    def key_for(self, block_key: BlockKey) -> str:
        return self._prefix + block_key.hex()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _failed(self, what: str, exc: BaseException) -> None:
        self._count("failures")
        was_open = self._breaker.is_open
        self._breaker.failure()
        if not was_open:
            logger.warning("Redis KV tier: %s failed (%r); recomputing instead until it answers again", what, exc)

    @property
    def available(self) -> bool:
        """False while the circuit breaker is open (Redis recently failed)."""
        return not self._breaker.is_open

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
        out["pending_writes"] = self._queue.qsize()
        return out

    # ---- reads -----------------------------------------------------------------------------
    def fetch_prefix(self, keys: Sequence[BlockKey]) -> list[DecodedBlock]:
        """Verified blocks for the longest leading run of ``keys`` present in Redis ([] on any
        failure, or while the breaker is open)."""
        if not keys or self._closed or not self._breaker.allow():
            return []
        self._count("lookups")
        found: list[DecodedBlock] = []
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.key_for(k))
            present = pipe.execute()
            n = 0
            while n < len(keys) and present[n]:
                n += 1
            for start in range(0, n, FETCH_CHUNK):
                part = keys[start:min(n, start + FETCH_CHUNK)]
                pipe = self._client.pipeline(transaction=False)
                for k in part:
                    pipe.get(self.key_for(k))
                for k, value in zip(part, pipe.execute()):
                    if value is None:  # expired or evicted since the EXISTS
                        return self._fetched(found)
                    try:
                        found.append(decode_block(value, self.layout, k))
                    except KVValueError as exc:
                        self._count("corrupt_values")
                        logger.warning("Redis KV tier: ignoring the value of %s (%s)", self.key_for(k), exc)
                        return self._fetched(found)
        except (redis.RedisError, OSError) as exc:
            self._failed("a read", exc)
            return self._fetched(found, ok=False)
        return self._fetched(found)

    def _fetched(self, found: list[DecodedBlock], ok: bool = True) -> list[DecodedBlock]:
        if ok:
            self._breaker.success()
        self._count("fetched_blocks", len(found))
        return found

    def count_prefix(self, keys: Sequence[BlockKey]) -> int | None:
        """How many of ``keys``, from the first, are present (one pipelined EXISTS round trip, not verified
        by value); None when Redis did not answer within the timeout, is skipped (breaker open) or closed."""
        if not keys:
            return 0
        if self._closed or not self._breaker.allow():
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.key_for(k))
            present = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._failed("a lookup", exc)
            return None
        self._breaker.success()
        n = 0
        while n < len(keys) and present[n]:
            n += 1
        return n

    # ---- writes ----------------------------------------------------------------------------
    def put(self, meta: BlockMeta, payload: bytes | memoryview, *, ttl_s: float | None = None) -> bool:
        """Queue one block for writing; False (counted) when the queue is full, Redis is down (the breaker is
        open) or the store closed. Its entry lives at least ``ttl_s`` seconds (a long retention's) or the
        store's ``ttl``, whichever is longer, and never less than it already had."""
        # a store without expiry keeps its entries for good: no retention outlives them
        ttl = self.ttl if ttl_s is None or self.ttl is None else max(ttl_s, self.ttl)
        item = _Put(meta, payload, None if ttl is None else _ms(ttl), retained=ttl_s is not None)
        return self._enqueue(item, "dropped_writes", 1)

    def retain(self, keys: Sequence[BlockKey], ttl_s: float) -> bool:
        """Queue a long retention of these blocks (never blocks): present entries get an expiry of at least
        ``ttl_s`` seconds from when the writer reaches them; absent ones are reported by ``take_missing``. False
        (counted) when the queue is full, Redis is down or the store closed."""
        if not keys:
            return True
        return self._enqueue(_Retain(tuple(keys), float(ttl_s)), "dropped_retains", len(keys))

    def take_missing(self) -> list[tuple[BlockKey, float]]:
        """(key, ttl_s) of retained blocks the writer found absent since the last call (thread-safe)."""
        out = []
        while self._missing:
            out.append(self._missing.popleft())
        return out

    @property
    def has_missing(self) -> bool:
        return bool(self._missing)

    def _enqueue(self, item: _Put | _Retain, dropped: str, n: int) -> bool:
        # While the breaker is open Redis is known down: queueing would only hold the blocks' bytes (a 15 s
        # outage grew a soak's RSS by 9%) for writes the engine makes again when it next computes them.
        if self._closed or self._breaker.is_open:
            self._count(dropped, n)
            return False
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._writer, name="prefixserve-redis-kv", daemon=True)
                    self._thread.start()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._count(dropped, n)
            return False
        return True

    def _writer(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            batch = [item]
            while len(batch) < WRITE_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
            except Exception:  # never let the writer die: count and go on
                logger.exception("Redis KV tier: writer error")
                self._dropped(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _dropped(self, batch: list[_Put | _Retain]) -> None:
        puts = sum(isinstance(item, _Put) for item in batch)
        self._count("dropped_writes", puts)
        self._count("dropped_retains", sum(len(item.keys) for item in batch if isinstance(item, _Retain)))

    def _write(self, batch: list[_Put | _Retain]) -> None:
        while not self._breaker.allow():
            if self._stop.is_set():
                self._dropped(batch)
                return
            time.sleep(0.05)
        try:
            try:
                replies = self._execute(batch, self._scripts)
            except redis.ResponseError as exc:
                if not (self._scripts and _scripts_refused(exc)):
                    raise
                self._scripts = False
                logger.warning("Redis KV tier: the server refuses scripts (%s); writing with plain SET / PEXPIRE, "
                               "which may shorten an entry's expiry", exc)
                replies = self._execute(batch, False)
        except (redis.RedisError, OSError) as exc:
            self._failed("a write", exc)
            self._dropped(batch)
            return
        self._breaker.success()
        i = 0
        for item in batch:
            if isinstance(item, _Put):
                self._count("writes")
                self._count("retained_writes", item.retained)
                i += 1
                continue
            present = replies[i:i + len(item.keys)]
            i += len(item.keys)
            missing = [k for k, p in zip(item.keys, present) if not p]
            self._count("retained_extended", len(item.keys) - len(missing))
            self._count("retained_missing", len(missing))
            self._missing.extend((k, item.ttl_s) for k in missing)

    def _execute(self, batch: list[_Put | _Retain], scripts: bool) -> list:
        """One pipeline round trip for the batch: one reply per put, one per retained key (truthy: present)."""
        pipe = self._client.pipeline(transaction=False)
        for item in batch:
            if isinstance(item, _Put):
                name, value = self.key_for(item.meta.key), encode_block(self.layout, item.meta, item.payload)
                if scripts:
                    pipe.eval(WRITE_SCRIPT, 1, name, value, item.ttl_ms or 0)
                else:
                    pipe.set(name, value, px=item.ttl_ms)
            else:
                ms = _ms(item.ttl_s)
                for k in item.keys:
                    if scripts:
                        pipe.eval(EXTEND_SCRIPT, 1, self.key_for(k), ms)
                    else:  # 1 when the key exists (its expiry set, even if that shortens it), 0 when absent
                        pipe.pexpire(self.key_for(k), ms)
        return pipe.execute()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued write was attempted (True) or ``timeout`` passed (False)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Flush (up to ``timeout``), stop the writer and close the connections.  Idempotent."""
        if self._closed:
            return
        # Redis known to be down: do not hold up shutdown for writes that cannot land.
        self.flush(timeout if self.available else min(timeout, 0.5))
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        atexit.unregister(self._atexit)
        try:
            self._client.close()
        except Exception:  # closing a broken connection must not raise at shutdown
            pass
