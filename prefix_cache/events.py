"""KV cache events: which blocks entered and left each tier, as plain records, for a publisher to ship
(engine/kv_events.py publishes them in vLLM's KV-event format, so KV-aware routers follow our cache).

``KVEventLog`` listens to the device pool (a BlockListener) and to the host tier (its on_insert /
on_remove hooks) and keeps this step's events in order; ``take()`` hands them over. Consecutive
stores that extend one chain (a prompt's blocks, committed together) become one ``Stored`` with
several hashes, as vLLM batches them; consecutive removals in one medium likewise.

Block hashes are the low 64 bits of our 16-byte block keys read big-endian, as vLLM derives its
integer block hashes from its own keys (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default): a
block's hash names it together with its whole prefix, so parent links follow.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .hashing import BlockKey

MEDIUM_GPU = "GPU"  # the device pool (vLLM-CPU also reports its main pool as "GPU")
MEDIUM_CPU = "CPU"  # the host-memory tier
MEDIUM_STORAGE = "STORAGE"  # the shared Redis tier (written through; every replica can load it)


def external_hash(key: BlockKey) -> int:
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


@dataclass
class Stored:
    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    medium: str


@dataclass
class Removed:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True)
class Cleared:
    """Every cached block of every tier we report is gone (a prefix-cache reset)."""


KVEvent = Stored | Removed | Cleared


@dataclass(eq=False)
class KVEventLog:
    """This step's KV events, in the order they happened (see module docstring)."""

    _events: list[KVEvent] = field(default_factory=list)

    # -- BlockListener (the device pool) ------------------------------------------------------
    def block_cached(self, block_id: int, key: BlockKey, parent_key: BlockKey | None,
                     token_ids: tuple[int, ...], ns: bytes) -> None:
        self.stored(key, parent_key, token_ids, MEDIUM_GPU)

    def block_evicted(self, block_id: int, key: BlockKey, parent_key: BlockKey | None,
                      token_ids: tuple[int, ...], ns: bytes) -> None:
        self.removed(key, MEDIUM_GPU)

    # -- any tier -------------------------------------------------------------------------------
    def stored(self, key: BlockKey, parent_key: BlockKey | None, token_ids: tuple[int, ...], medium: str) -> None:
        h = external_hash(key)
        parent = None if parent_key is None else external_hash(parent_key)
        last = self._events[-1] if self._events else None
        if isinstance(last, Stored) and last.medium == medium and parent is not None and last.block_hashes[-1] == parent:
            last.block_hashes.append(h)
            last.token_ids.extend(token_ids)
        else:
            self._events.append(Stored([h], parent, list(token_ids), medium))

    def removed(self, key: BlockKey, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, Removed) and last.medium == medium:
            last.block_hashes.append(external_hash(key))
        else:
            self._events.append(Removed([external_hash(key)], medium))

    def cleared(self) -> None:
        self._events.append(Cleared())

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
