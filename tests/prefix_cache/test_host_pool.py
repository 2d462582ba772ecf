"""HostKVPool: byte-bounded LRU of host KV slots, pins, swap slots; integrity after every operation."""
from __future__ import annotations

import random

import pytest

from prefix_cache import HostKVPool
from prefix_cache.hashing import block_key


def _key(i: int) -> bytes:
    return block_key(None, [i, i + 1])


def _insert(pool: HostKVPool, i: int):
    placed = pool.insert(_key(i), None, (i, i + 1), b"ns")
    pool.check_integrity()
    return placed


def test_sized_by_bytes():
    assert HostKVPool.from_bytes(10_000, 1_000).num_slots == 10
    assert HostKVPool.from_bytes(10_999, 1_000).num_slots == 10
    with pytest.raises(ValueError):
        HostKVPool.from_bytes(999, 1_000)


def test_lru_eviction_and_touch():
    pool = HostKVPool(3)
    slots = [_insert(pool, i)[0] for i in range(3)]
    assert pool.num_free == 0
    pool.touch(slots[0])  # 0 is now the most recent: 1 is the LRU
    slot, is_new = _insert(pool, 3)
    assert is_new and slot == slots[1]
    assert pool.lookup(_key(1)) is None and pool.lookup(_key(0)) == slots[0]
    assert pool.num_evictions == 1
    # re-inserting a cached key copies nothing and refreshes it
    assert _insert(pool, 0) == (slots[0], False)
    _insert(pool, 4)
    assert pool.lookup(_key(2)) is None and pool.lookup(_key(0)) is not None


def test_confirm_compares_parent_tokens_and_namespace():
    pool = HostKVPool(2)
    parent = _key(9)
    slot, _ = pool.insert(_key(1), parent, (1, 2), b"ns")
    assert pool.confirm(slot, parent, [1, 2], b"ns")
    assert not pool.confirm(slot, parent, [1, 3], b"ns")
    assert not pool.confirm(slot, None, [1, 2], b"ns")
    assert not pool.confirm(slot, parent, [1, 2], b"other")


def test_pinned_slots_are_never_evicted():
    pool = HostKVPool(2)
    a, _ = _insert(pool, 0)
    b, _ = _insert(pool, 1)
    pool.pin(a)
    pool.pin(b)
    pool.check_integrity()
    assert _insert(pool, 2) is None  # nothing evictable: dropped, nothing changed
    assert pool.lookup(_key(0)) == a and pool.lookup(_key(1)) == b
    pool.unpin(a)
    pool.check_integrity()
    slot, _ = _insert(pool, 2)
    assert slot == a
    with pytest.raises(ValueError):
        pool.unpin(a)  # the new entry has no pin
    pool.unpin(b)
    pool.check_integrity()


def test_swap_slots_take_room_from_the_cache_and_come_back():
    pool = HostKVPool(4)
    for i in range(3):
        _insert(pool, i)
    pool.pin(pool.lookup(_key(2)))
    assert pool.take_swap_slots(4) is None  # one slot is pinned: only 3 can be had
    pool.check_integrity()
    swap = pool.take_swap_slots(3)
    pool.check_integrity()
    assert len(swap) == 3 and pool.num_swap == 3 and pool.num_cached == 1
    assert _insert(pool, 7) is None  # swap slots are not evictable either
    for s in swap:
        pool.release_swap_slot(s)
        pool.check_integrity()
    assert pool.num_free == 3


def test_discard_frees_the_slot():
    pool = HostKVPool(2)
    slot, _ = _insert(pool, 0)
    pool.discard(slot)
    pool.check_integrity()
    assert pool.lookup(_key(0)) is None and pool.num_free == 2


def test_random_operations_keep_integrity_and_match_a_model():
    rng = random.Random(0)
    pool = HostKVPool(6)
    lru: list[int] = []  # model: unpinned cached key ids, oldest first
    pinned: dict[int, int] = {}
    swaps: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            i = rng.randrange(20)
            free_before = pool.num_free
            room = free_before + len(lru)
            placed = pool.insert(_key(i), None, (i, i + 1), b"ns")
            if i in lru:
                assert placed is not None and not placed[1]
                lru.remove(i)
                lru.append(i)
            elif i in pinned:
                assert placed is not None and not placed[1]
            elif room == 0:
                assert placed is None
            else:
                assert placed is not None and placed[1]
                if not free_before:  # the least recently used unpinned block made room
                    assert pool.lookup(_key(lru.pop(0))) is None
                lru.append(i)
        elif op < 0.65 and lru:
            i = rng.choice(lru)
            pool.pin(pool.lookup(_key(i)))
            lru.remove(i)
            pinned[i] = pinned.get(i, 0) + 1
        elif op < 0.8 and pinned:
            i = rng.choice(sorted(pinned))
            pool.unpin(pool.lookup(_key(i)))
            pinned[i] -= 1
            if not pinned[i]:
                del pinned[i]
                lru.append(i)
        elif op < 0.9:
            n = rng.randrange(3)
            got = pool.take_swap_slots(n)
            if got is None:
                assert n > pool.num_free + len(lru)
            else:
                swaps.extend(got)
                lru = [i for i in lru if pool.lookup(_key(i)) is not None]
        elif swaps:
            pool.release_swap_slot(swaps.pop(rng.randrange(len(swaps))))
        pool.check_integrity()
        assert sorted(lru) == sorted(i for i in range(20) if pool.lookup(_key(i)) is not None and i not in pinned)
