"""KV events in vLLM's format, so KV-aware routers (NVIDIA Dynamo, llm-d, ...) can follow our cache.

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

Each engine step's events (prefix_cache/events.py: blocks stored in / removed from the device pool
"GPU" and the host tier "CPU", blocks written through to the shared Redis tier "STORAGE" (locality
"REMOTE"; its TTL expiries are not observable, so never removed), and AllBlocksCleared on a
prefix-cache reset) go out as one
KVEventBatch, msgpack-encoded exactly as vLLM 0.32's vllm/distributed/kv_events.py encodes it: a
batch is an array [ts, events, data_parallel_rank]; an event is a map tagged by its class name
("type": "BlockStored" ...). On the PUB socket every batch is the multipart message
[topic, sequence number (8 bytes big-endian), payload]; a ROUTER replay socket answers a request
[start sequence (8 bytes)] with every buffered batch from there, then the end marker (-1, b"").

The publisher thread owns the sockets (ZMQ sockets are not thread-safe); the engine only enqueues.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Any

import msgspec

from engine.config_json import from_keys, json_object
from engine.errors import InvalidConfigError
from prefix_cache.events import MEDIUM_CPU, MEDIUM_STORAGE, Cleared, KVEvent, KVEventLog, Removed, Stored

logger = logging.getLogger("prefixserve.kv_events")

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field (`--kv-events-config` takes the same JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (as vLLM)
    endpoint: str = "tcp://*:5557"  # bind when it has a wildcard, else connect (as vLLM)
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise InvalidConfigError(f"kv_events_config.publisher must be one of {PUBLISHERS}, got {self.publisher!r}.")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise InvalidConfigError(f"kv_events_config.endpoint must be a zmq address, got {self.endpoint!r}.")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise InvalidConfigError(f"kv_events_config.{name} must be >= 1, got {getattr(self, name)}.")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """From the JSON text of the flag, a dict, or itself; a clear error names unknown keys."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        return from_keys(cls, json_object(value, "kv_events_config"), "kv_events_config")


# -- vLLM 0.32's wire types (vllm/distributed/kv_events.py) -------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Tagged with the class name ("type"), encoded as a map."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    locality: str | None = None  # "LOCAL" or "REMOTE", relative to the publisher


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event: KVEvent, block_size: int) -> KVCacheEvent:
    if isinstance(event, Stored):
        # Redis is shared: relative to this publisher its blocks are remote (any replica can load them).
        locality = "REMOTE" if event.medium == MEDIUM_STORAGE else "LOCAL"
        return BlockStored(event.block_hashes, event.parent_hash, event.token_ids, block_size, None, event.medium,
                           None, locality)
    if isinstance(event, Removed):
        return BlockRemoved(event.block_hashes, event.medium, "LOCAL")
    assert isinstance(event, Cleared)
    return AllBlocksCleared()


# -- publishing -----------------------------------------------------------------------------------
class ZmqPublisher:
    """vLLM's ZmqEventPublisher behaviour: PUB socket, sequence numbers from 0, replay buffer."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import zmq
        except ImportError:
            raise InvalidConfigError("KV events need pyzmq: pip install 'prefixserve[kv-events]'") from None
        self._zmq = zmq
        self._config = config
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="prefixserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # a step never waits for subscribers; the sequence gap tells them
            self.dropped += 1

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            n = next(seq)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, n.to_bytes(8, "big"), payload))
            except self._zmq.ZMQError:
                logger.exception("publishing KV events failed")
            self._buffer.append((n, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("invalid KV-event replay request: %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for n, payload in list(self._buffer):
            if n >= first:
                self._replay.send_multipart((client, b"", n.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


class KVEvents:
    """The engine's KV-event source: the log listening to the tiers, and (when configured) the
    publisher. Disabled, it is a null object that records nothing and costs nothing."""

    def __init__(self, config: KVEventsConfig | None, blocks, tiers) -> None:
        self.enabled = config is not None and config.active
        self.block_size = blocks.block_size
        self.log = KVEventLog()
        self._publisher: ZmqPublisher | None = None
        if not self.enabled:
            return
        self._publisher = ZmqPublisher(config)
        blocks.add_listener(self.log)
        if tiers.host is not None:
            tiers.host.on_insert = lambda key, parent, tokens: self.log.stored(key, parent, tokens, MEDIUM_CPU)
            tiers.host.on_remove = lambda key: self.log.removed(key, MEDIUM_CPU)
        if tiers.remote is not None:
            tiers.on_remote_write = lambda m: self.log.stored(m.key, m.parent_key, m.token_ids, MEDIUM_STORAGE)

    def cleared(self) -> None:
        if self.enabled:
            self.log.cleared()

    def publish(self) -> None:
        """This step's events, as one batch (nothing when there were none)."""
        if not self.enabled:
            return
        events = self.log.take()
        if events:
            self._publisher.publish(KVEventBatch(time.time(), [to_wire(e, self.block_size) for e in events], 0))

    def close(self) -> None:
        if self._publisher is not None:
            self.publish()
            self._publisher.close()
            self._publisher = None
