"""RedisKVStore: KV blocks shared through Redis by every replica of one model.

Keys::

    <prefix>:kv:v<format>:<model fingerprint>:<dtype>:bs<block_size>:tp<rank>of<size>:<block key hex>

(``KVLayout.namespace`` is everything before the block key; ``<dtype>`` is the model dtype, followed by
``-float8_e4m3fn`` for an fp8 KV cache, whose values also name float8_e4m3fn as their dtype.)  Values are ``kv_codec`` bytes:
self-describing and checksummed, never pickle.  A value that is corrupt, truncated or foreign is
ignored and counted; the engine then recomputes the block and its write-through replaces it.

Reads (``fetch_prefix``) run on the caller's thread at admission: one pipelined EXISTS for all
candidate keys, then pipelined GETs of the leading run of present keys in chunks, stopping at
the first missing or invalid value.  Writes (``put``) never block: they enter a bounded queue
that one background thread drains in pipelined batches (SET, with EX when a TTL is set); a full
queue drops the write and counts it.

Faults: every call has short socket and connect timeouts and redis-py's own retries are off.  A
failure opens a circuit breaker (backoff 0.5 s doubling to 10 s): while it is open, reads return
no hits at once and the writer waits (its queue keeps absorbing writes and drops the overflow).
When the backoff ends one call probes the server -- redis-py reconnects by itself -- and success
closes the breaker.  Redis down, slow or flapping thus costs at most one timeout per backoff
period and never fails a request.

This module imports redis; ``prefix_cache`` itself never imports it (the engine imports this
module only when a Redis URL is configured).
"""

from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .hashing import BlockKey
from .kv_codec import FORMAT_VERSION, BlockMeta, DecodedBlock, KVLayout, KVValueError, decode_block, encode_block

logger = logging.getLogger("prefixserve")

FETCH_CHUNK = 16  # GETs per pipeline round trip: bounds one reply's size, stops soon after a bad value
WRITE_BATCH = 32  # SETs per pipeline round trip
DEFAULT_MAX_PENDING_BYTES = 256 << 20


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
                        "corrupt_values": 0}
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

    # ---- writes ----------------------------------------------------------------------------
    def put(self, meta: BlockMeta, payload: bytes | memoryview) -> bool:
        """Queue one block for writing; False (counted) when the queue is full or the store closed."""
        if self._closed:
            self._count("dropped_writes")
            return False
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._writer, name="prefixserve-redis-kv", daemon=True)
                    self._thread.start()
        try:
            self._queue.put_nowait((meta, payload))
        except queue.Full:
            self._count("dropped_writes")
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
                self._count("dropped_writes", len(batch))
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _write(self, batch: list[tuple[BlockMeta, bytes | memoryview]]) -> None:
        while not self._breaker.allow():
            if self._stop.is_set():
                self._count("dropped_writes", len(batch))
                return
            time.sleep(0.05)
        try:
            pipe = self._client.pipeline(transaction=False)
            for meta, payload in batch:
                pipe.set(self.key_for(meta.key), encode_block(self.layout, meta, payload), ex=self.ttl)
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._failed("a write", exc)
            self._count("dropped_writes", len(batch))
            return
        self._breaker.success()
        self._count("writes", len(batch))

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
