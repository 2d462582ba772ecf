"""A fixed pool of KV block ids with reference counts, a FIFO free list and LRU eviction.

Every block is in exactly one of three states:

  FREE       ref_count 0, not cached, on the free list;
  EVICTABLE  ref_count 0, cached in the radix index (its KV is still valid and can be revived);
  IN_USE     ref_count > 0 (cached or not).

Invariants (checked by ``check_integrity``):
  * free + evictable + in_use == num_blocks;
  * a block with ref_count > 0 is never evicted and never on the free list;
  * no free block is in the index;
  * a cached block with ref_count > 0 has a parent with ref_count > 0.  Whoever holds a cached
    block also holds its whole prefix, so a ref-0 cached block has only ref-0 descendants and
    every EVICTABLE block really can be evicted (leaves first).  That is what makes it sound to
    count evictable blocks as free for admission;
  * every evictable leaf has a live heap entry, so eviction never has to scan.

Eviction takes the least-recently-used evictable LEAF, so a block's parent is never evicted
before its children.  ``evict(0)`` is safe.  Access times come from a counter, not a clock, so
eviction order is deterministic.

``on_evict`` (optional) is told about every evicted block -- ``on_evict(block_id, key, parent_key,
token_ids, ns)`` -- while its KV is still intact in the device pool (nothing overwrites a block
before the next forward), so a slower tier can demote it.  It must not call back into the pool.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from .hashing import BlockKey
from .radix import RadixIndex


class NoFreeBlocksError(RuntimeError):
    """Raised when a block is needed and none is free or evictable."""


class BlockPool:
    """Owns ``num_blocks`` block ids, their reference counts and the radix index of cached ones.

    Allocation pops the front of the free list (initially ``[0, 1, ..., N-1]``); blocks that
    become free are appended at the back.  Only when the free list is empty is a block evicted.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.index = RadixIndex(block_size)
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Membership mirror of _free so "is it free?" is O(1); the deque keeps the order.
        self._free_set: set[int] = set(range(num_blocks))
        self._last_access = [0] * num_blocks
        self._clock = 0
        # (last_access, block_id) of evictable leaves; entries go stale instead of being removed
        # (lazy invalidation) and are skipped when popped.
        self._heap: list[tuple[int, int]] = []
        self._num_evictable = 0
        self._num_in_use = 0
        self.peak_in_use = 0
        self.num_evictions = 0
        self.on_evict: Callable[[int, BlockKey, BlockKey | None, tuple[int, ...], bytes], None] | None = None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_in_use(self) -> int:
        return self._num_in_use

    @property
    def num_available(self) -> int:
        """Blocks an allocation can obtain: truly free plus evictable."""
        return len(self._free) + self._num_evictable

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_set

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.index

    def is_evictable(self, block_id: int) -> bool:
        return self._ref[block_id] == 0 and block_id in self.index

    def last_access(self, block_id: int) -> int:
        return self._last_access[block_id]

    def free_list(self) -> list[int]:
        return list(self._free)

    # ---- reference counting ----------------------------------------------------------------
    def _touch(self, block_id: int) -> None:
        self._clock += 1
        self._last_access[block_id] = self._clock

    def _note_in_use(self) -> None:
        self._num_in_use += 1
        if self._num_in_use > self.peak_in_use:
            self.peak_in_use = self._num_in_use

    def allocate(self) -> int:
        """Take a block with ref_count 1: the free list first, else evict the LRU leaf."""
        if self._free:
            block_id = self._free.popleft()
            self._free_set.discard(block_id)
        else:
            evicted = self._evict_one()
            if evicted is None:
                raise NoFreeBlocksError("no free or evictable KV blocks")
            block_id = evicted
        self._ref[block_id] = 1
        self._note_in_use()
        self._touch(block_id)
        return block_id

    def incref(self, block_id: int) -> None:
        """Add a reference to an in-use or evictable (revived) block; a free block has no data."""
        ref = self._ref[block_id]
        if ref == 0:
            if block_id not in self.index:
                raise ValueError(f"block {block_id} is free; allocate it instead of incref")
            # revived: its heap entry goes stale because ref > 0
            self._num_evictable -= 1
            self._note_in_use()
        self._ref[block_id] = ref + 1
        self._touch(block_id)

    def decref(self, block_id: int) -> None:
        """Drop a reference; at 0 a cached block becomes evictable, an uncached one free."""
        ref = self._ref[block_id]
        if ref <= 0:
            raise ValueError(f"block {block_id} has no references to drop")
        self._ref[block_id] = ref - 1
        if ref > 1:
            return
        self._num_in_use -= 1
        self._touch(block_id)
        if block_id in self.index:
            self._num_evictable += 1
            if self.index.is_leaf(block_id):
                self._push(block_id)
        else:
            self._free.append(block_id)
            self._free_set.add(block_id)

    def register(
        self, block_id: int, key: BlockKey, parent: int | None, token_ids: Sequence[int], ns: bytes
    ) -> None:
        """Cache an in-use full block under ``key`` as a child of ``parent``."""
        if self._ref[block_id] <= 0:
            raise ValueError(f"only in-use blocks can be cached (block {block_id})")
        if parent is not None and self._ref[parent] <= 0:
            # keeps "a cached in-use block has an in-use parent" true
            raise ValueError(f"parent block {parent} must be in use")
        self.index.insert(block_id, key, parent, token_ids, ns)

    # ---- eviction ----------------------------------------------------------------------------
    def _entry_is_live(self, access: int, block_id: int) -> bool:
        return (
            self._ref[block_id] == 0
            and block_id in self.index
            and self.index.is_leaf(block_id)
            and self._last_access[block_id] == access
        )

    def _evict_one(self) -> int | None:
        """Remove the LRU evictable leaf from the index; the caller decides where it goes."""
        while self._heap:
            access, block_id = heapq.heappop(self._heap)
            if not self._entry_is_live(access, block_id):
                continue
            index = self.index
            if self.on_evict is not None:
                parent = index.parent_of(block_id)
                evicted = (block_id, index.key_of(block_id), None if parent is None else index.key_of(parent),
                           index.tokens_of(block_id), index.ns_of(block_id))
            parent = index.remove(block_id)
            self._num_evictable -= 1
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(*evicted)
            # The parent may just have become an evictable leaf.
            if parent is not None and self._ref[parent] == 0 and self.index.is_leaf(parent):
                self._push(parent)
            return block_id
        if self._num_evictable:
            raise RuntimeError("evictable blocks exist but none is an evictable leaf")
        return None

    def _push(self, block_id: int) -> None:
        """Add a heap entry for a block that just became an evictable leaf."""
        # Stale entries accumulate while blocks are revived and released again; rebuilding once
        # the heap is several times larger than the pool keeps memory bounded, and since at most
        # num_blocks entries survive a rebuild its cost is O(1) amortized per push.
        if len(self._heap) > 4 * self.num_blocks + 64:
            self._heap = [entry for entry in self._heap if self._entry_is_live(*entry)]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (self._last_access[block_id], block_id))

    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to ``num_blocks`` evictable blocks (LRU leaves first) onto the free list."""
        evicted: list[int] = []
        while len(evicted) < num_blocks:
            block_id = self._evict_one()
            if block_id is None:
                break
            self._free.append(block_id)
            self._free_set.add(block_id)
            evicted.append(block_id)
        return evicted

    def clear_cached(self) -> int:
        """Free every evictable cached block without reporting it to ``on_evict``; returns how many."""
        on_evict, self.on_evict = self.on_evict, None
        try:
            return len(self.evict(self.num_evictable))
        finally:
            self.on_evict = on_evict

    # ---- checks ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.index.check_integrity()
        n = self.num_blocks
        if len(self._free) != len(self._free_set) or set(self._free) != self._free_set:
            raise AssertionError("free list has duplicates or disagrees with its set")
        free = evictable = in_use = 0
        live = {entry for entry in self._heap if self._entry_is_live(*entry)}
        for b in range(n):
            ref = self._ref[b]
            cached = b in self.index
            if ref < 0:
                raise AssertionError(f"block {b} has negative ref_count")
            if b in self._free_set:
                if ref or cached:
                    raise AssertionError(f"free block {b} is referenced or cached")
                free += 1
            elif ref == 0:
                if not cached:
                    raise AssertionError(f"block {b} has ref 0, is not cached and not free (leaked)")
                evictable += 1
                if self.index.is_leaf(b) and (self._last_access[b], b) not in live:
                    raise AssertionError(f"evictable leaf {b} has no heap entry")
            else:
                in_use += 1
            if cached and ref > 0:
                parent = self.index.parent_of(b)
                if parent is not None and self._ref[parent] == 0:
                    raise AssertionError(f"in-use cached block {b} has an unreferenced parent {parent}")
        if free + evictable + in_use != n:
            raise AssertionError("free + evictable + in_use != num_blocks")
        if evictable != self._num_evictable or in_use != self._num_in_use:
            raise AssertionError("cached state counters are wrong")
        if self.peak_in_use < in_use:
            raise AssertionError("peak_in_use below current use")
