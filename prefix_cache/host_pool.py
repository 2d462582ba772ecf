"""Host-memory KV slots: an LRU cache of full blocks below the device pool, plus swap space.

The pool only does the bookkeeping (which slot holds which block, what may be evicted); the
engine's model runner owns the host tensor ``[num_slots, L, 2, block_size, Hkv, D]`` and moves the
bytes.  Pure Python, like the rest of prefix_cache.

Every slot is in exactly one of three states:

  FREE    on the free list;
  CACHED  holds the full block ``key`` (with its parent key, tokens and namespace, so a hit is
          confirmed token by token, never by key alone); evictable unless pinned;
  SWAP    holds one block of a preempted sequence (``preemption_mode="swap"``); never evicted,
          released by ``release_swap_slot`` once swapped back in or no longer needed.

Invariants (checked by ``check_integrity``):
  * free + cached + swap == num_slots, and the three sets are disjoint;
  * key -> slot and slot -> entry describe the same cached slots;
  * the LRU order lists exactly the cached slots with no pins;
  * pin counts are >= 0 and only cached slots have them.

Eviction takes the least-recently-used unpinned cached slot.  A pinned slot is the source of a
load scheduled this step: its bytes must survive until the load ran.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .hashing import BlockKey


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    parent_key: BlockKey | None
    token_ids: tuple[int, ...]
    ns: bytes
    pins: int = 0


class HostKVPool:
    """``num_slots`` host KV slots (see module docstring).  ``from_bytes`` sizes it by a byte budget."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._entries: dict[int, _Entry] = {}
        self._by_key: dict[BlockKey, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned cached slots, oldest first
        self._swap: set[int] = set()
        self.num_inserts = 0
        self.num_evictions = 0
        # Told when a block enters (key, parent_key, token_ids) or leaves (key) the host cache (KV events).
        self.on_insert: Callable[[BlockKey, BlockKey | None, tuple[int, ...]], None] | None = None
        self.on_remove: Callable[[BlockKey], None] | None = None

    @classmethod
    def from_bytes(cls, capacity_bytes: int, block_bytes: int) -> HostKVPool:
        """As many slots of ``block_bytes`` as fit in ``capacity_bytes`` (at least one)."""
        if block_bytes < 1:
            raise ValueError("block_bytes must be >= 1")
        num_slots = capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"{capacity_bytes} bytes hold no KV block of {block_bytes} bytes")
        return cls(num_slots)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_swap(self) -> int:
        return len(self._swap)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def swap_slots(self) -> set[int]:
        return set(self._swap)

    def cached_slots(self) -> list[int]:
        return list(self._entries)

    def lookup(self, key: BlockKey) -> int | None:
        """Slot caching ``key``, or None.  Pure: LRU order unchanged."""
        return self._by_key.get(key)

    def key_of(self, slot: int) -> BlockKey:
        return self._entries[slot].key

    def pins(self, slot: int) -> int:
        return self._entries[slot].pins

    def confirm(self, slot: int, parent_key: BlockKey | None, token_ids: Sequence[int], ns: bytes) -> bool:
        """True iff ``slot`` caches the block with exactly this parent, these tokens, this namespace."""
        e = self._entries.get(slot)
        return e is not None and e.parent_key == parent_key and e.ns == ns and e.token_ids == tuple(token_ids)

    # ---- cache -----------------------------------------------------------------------------
    def touch(self, slot: int) -> None:
        """Mark a cached slot most recently used."""
        if self._entries[slot].pins == 0:
            self._lru.move_to_end(slot)

    def insert(
        self, key: BlockKey, parent_key: BlockKey | None, token_ids: Sequence[int], ns: bytes
    ) -> tuple[int, bool] | None:
        """Cache a block: ``(slot, True)`` when the caller must now fill ``slot`` with its bytes;
        ``(slot, False)`` when the key is already cached there (touched, nothing to copy);
        None when every slot is pinned or swap (nothing changed)."""
        slot = self._by_key.get(key)
        if slot is not None:
            self.touch(slot)
            return slot, False
        slot = self._take_slot()
        if slot is None:
            return None
        self._entries[slot] = _Entry(key, parent_key, tuple(token_ids), ns)
        self._by_key[key] = slot
        self._lru[slot] = None
        self.num_inserts += 1
        if self.on_insert is not None:
            self.on_insert(key, parent_key, tuple(token_ids))
        return slot, True

    def discard(self, slot: int) -> None:
        """Forget a cached slot whose bytes cannot be trusted (e.g. its copy never ran)."""
        e = self._entries[slot]
        if e.pins:
            raise ValueError(f"slot {slot} is pinned")
        del self._entries[slot]
        del self._by_key[e.key]
        del self._lru[slot]
        self._free.append(slot)
        if self.on_remove is not None:
            self.on_remove(e.key)

    def clear_cached(self) -> int:
        """Forget every unpinned cached slot (a prefix-cache reset; not reported to ``on_remove``)."""
        on_remove, self.on_remove = self.on_remove, None
        try:
            slots = list(self._lru)
            for slot in slots:
                self.discard(slot)
            return len(slots)
        finally:
            self.on_remove = on_remove

    def pin(self, slot: int) -> None:
        """Protect a cached slot from eviction (a load from it is pending)."""
        e = self._entries[slot]
        if e.pins == 0:
            del self._lru[slot]
        e.pins += 1

    def unpin(self, slot: int) -> None:
        e = self._entries[slot]
        if e.pins <= 0:
            raise ValueError(f"slot {slot} is not pinned")
        e.pins -= 1
        if e.pins == 0:
            self._lru[slot] = None  # most recently used: it was just read

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        e = self._entries.pop(slot)
        del self._by_key[e.key]
        self.num_evictions += 1
        if self.on_remove is not None:
            self.on_remove(e.key)
        return slot

    # ---- swap space ------------------------------------------------------------------------
    def take_swap_slots(self, n: int) -> list[int] | None:
        """``n`` slots for a preempted sequence's blocks (evicting LRU cached blocks as needed), or
        None -- and nothing changed -- when fewer than ``n`` can be had."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free) + len(self._lru):
            return None
        slots = []
        for _ in range(n):
            slot = self._take_slot()
            assert slot is not None  # guaranteed by the count above
            self._swap.add(slot)
            slots.append(slot)
        return slots

    def release_swap_slot(self, slot: int) -> None:
        self._swap.remove(slot)
        self._free.append(slot)

    # ---- checks ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list has duplicates")
        cached = set(self._entries)
        if free & cached or free & self._swap or cached & self._swap:
            raise AssertionError("a slot is in two states")
        if len(free) + len(cached) + len(self._swap) != self.num_slots:
            raise AssertionError("free + cached + swap != num_slots")
        if not all(0 <= s < self.num_slots for s in free | cached | self._swap):
            raise AssertionError("slot id out of range")
        if len(self._by_key) != len(self._entries):
            raise AssertionError("key map and entries differ in size")
        for key, slot in self._by_key.items():
            if self._entries.get(slot) is None or self._entries[slot].key != key:
                raise AssertionError(f"key map points slot {slot} at the wrong entry")
        unpinned = {s for s, e in self._entries.items() if e.pins == 0}
        if set(self._lru) != unpinned or len(self._lru) != len(unpinned):
            raise AssertionError("LRU order does not list exactly the unpinned cached slots")
        if any(e.pins < 0 for e in self._entries.values()):
            raise AssertionError("negative pin count")
