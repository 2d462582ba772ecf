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

Retention (an agent's context kept across a tool call, a system prompt warmed before traffic) is an
eviction *order*, not a pin: a retained evictable leaf is evicted only once no other evictable leaf is
left, so retention never refuses an allocation.  ``retain(block_id, until)`` keeps a cached block
retained until that time of ``clock`` (retention expires by TTL, and a block's retention is the latest
``until`` asked for it); at most ``max_retained`` blocks are retained, past which the retention that
expires first lapses first.  Retained and not: LRU within each.  Callers retain whole chains (a prefix),
so a retained block's ancestors are retained too; leaves-first eviction keeps parents after children
either way.

``on_evict`` (optional) is told about every evicted block -- ``on_evict(block_id, key, parent_key,
token_ids, ns)`` -- while its KV is still intact in the device pool (nothing overwrites a block
before the next forward), so a slower tier can demote it.  It must not call back into the pool.
"""

from __future__ import annotations

import heapq
import time
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

    def __init__(self, num_blocks: int, block_size: int, *, max_retained: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if max_retained is not None and not 0 <= max_retained <= num_blocks:
            raise ValueError(f"max_retained must be in [0, {num_blocks}], got {max_retained}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.index = RadixIndex(block_size)
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Membership mirror of _free so "is it free?" is O(1); the deque keeps the order.
        self._free_set: set[int] = set(range(num_blocks))
        self._last_access = [0] * num_blocks
        self._clock = 0
        # (retained, last_access, block_id) of evictable leaves, retained ones (1) after the others (0);
        # entries go stale instead of being removed (lazy invalidation) and are skipped when popped.
        self._heap: list[tuple[int, int, int]] = []
        self.max_retained = num_blocks if max_retained is None else max_retained
        self.clock = clock
        self._retained: dict[int, float] = {}  # block id -> retained until (clock time)
        self._expiry: list[tuple[float, int]] = []  # (until, block_id), stale once _retained differs
        self.num_retention_expired = 0  # retentions that ran out (TTL) or lapsed (cap)
        self.num_retained_evicted = 0  # retained blocks evicted all the same (nothing else was left)
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

    def is_retained(self, block_id: int) -> bool:
        self._expire()
        return block_id in self._retained

    @property
    def num_retained(self) -> int:
        self._expire()
        return len(self._retained)

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

    # ---- retention ---------------------------------------------------------------------------
    def retain(self, block_id: int, until: float) -> None:
        """Keep a cached block retained until clock time ``until`` (a later ``until`` than it has extends it;
        an earlier one changes nothing: see ``release``)."""
        if block_id not in self.index:
            raise ValueError(f"block {block_id} is not cached; only cached blocks can be retained")
        self._expire()
        if until <= self.clock() or until <= self._retained.get(block_id, float("-inf")):
            return
        was = block_id in self._retained
        self._retained[block_id] = until
        if len(self._expiry) > 4 * self.num_blocks + 64:  # stale entries of extended retentions: bounded
            self._expiry = [(u, b) for b, u in self._retained.items()]
            heapq.heapify(self._expiry)
        else:
            heapq.heappush(self._expiry, (until, block_id))
        if not was and self.is_evictable(block_id) and self.index.is_leaf(block_id):
            self._push(block_id)  # its unretained entry goes stale
        while len(self._retained) > self.max_retained:
            self._lapse_first()

    def release(self, block_id: int) -> None:
        """End a block's retention now (it is evicted in LRU order with the others from then on)."""
        if self._retained.pop(block_id, None) is not None and self.is_evictable(block_id) \
                and self.index.is_leaf(block_id):
            self._push(block_id)

    def _lapse_first(self) -> None:
        """End the retention that expires first."""
        while self._expiry:
            until, block_id = heapq.heappop(self._expiry)
            if self._retained.get(block_id) == until:
                self.release(block_id)
                self.num_retention_expired += 1
                return

    def _expire(self) -> None:
        """End every retention whose time has come."""
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            until, block_id = heapq.heappop(self._expiry)
            if self._retained.get(block_id) == until:  # else stale: extended, released or evicted since
                self.release(block_id)
                self.num_retention_expired += 1

    def _tier(self, block_id: int) -> int:
        return 1 if block_id in self._retained else 0

    # ---- eviction ----------------------------------------------------------------------------
    def _entry_is_live(self, tier: int, access: int, block_id: int) -> bool:
        return (
            self._ref[block_id] == 0
            and block_id in self.index
            and self.index.is_leaf(block_id)
            and self._last_access[block_id] == access
            and self._tier(block_id) == tier
        )

    def _evict_one(self) -> int | None:
        """Remove the LRU evictable leaf (retained ones last) from the index; the caller decides where it goes."""
        self._expire()
        while self._heap:
            tier, access, block_id = heapq.heappop(self._heap)
            if not self._entry_is_live(tier, access, block_id):
                continue
            if self._retained.pop(block_id, None) is not None:
                self.num_retained_evicted += 1
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
        heapq.heappush(self._heap, (self._tier(block_id), self._last_access[block_id], block_id))

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
        retained_evicted = self.num_retained_evicted
        try:
            return len(self.evict(self.num_evictable))
        finally:
            self.on_evict = on_evict
            self.num_retained_evicted = retained_evicted  # a reset, not evictions

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
                if self.index.is_leaf(b) and (self._tier(b), self._last_access[b], b) not in live:
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
        for b, until in self._retained.items():
            if b not in self.index:
                raise AssertionError(f"retained block {b} is not cached")
            if (until, b) not in self._expiry:
                raise AssertionError(f"retained block {b} has no expiry entry")
        if len(self._retained) > self.max_retained:
            raise AssertionError("more blocks retained than max_retained")
