import pytest

from prefix_cache import BlockPool, NoFreeBlocksError

from pool_testlib import NS, cache_chain, release


def test_free_list_is_fifo():
    pool = BlockPool(5, 2)
    assert pool.free_list() == [0, 1, 2, 3, 4]
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2)
    pool.decref(b)
    pool.decref(a)
    assert pool.free_list() == [3, 4, 1, 0]
    assert [pool.allocate() for _ in range(4)] == [3, 4, 1, 0]
    pool.check_integrity()
    assert pool.peak_in_use == 5


def test_exhaustion_raises_and_counts_hold():
    pool = BlockPool(2, 2)
    pool.allocate()
    pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    assert (pool.num_free, pool.num_evictable, pool.num_in_use) == (0, 0, 2)
    pool.check_integrity()


def test_cached_block_becomes_evictable_not_free():
    pool = BlockPool(4, 2)
    ids = cache_chain(pool, [1, 2, 3, 4])
    release(pool, ids)
    assert pool.free_list() == [2, 3]
    assert pool.num_evictable == 2 and pool.num_available == 4
    # revive
    pool.incref(0)
    assert pool.num_evictable == 1 and pool.num_in_use == 1
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.incref(2)  # free blocks hold no data: allocate them


def test_free_blocks_are_used_before_evicting():
    pool = BlockPool(4, 2)
    release(pool, cache_chain(pool, [1, 2, 3, 4]))
    assert pool.allocate() == 2
    assert pool.allocate() == 3
    assert pool.num_evictions == 0
    assert pool.allocate() == 1  # the leaf goes first
    assert pool.num_evictions == 1
    assert not pool.is_cached(1) and pool.is_cached(0)
    pool.check_integrity()


def test_lru_leaves_first_children_before_parents():
    pool = BlockPool(8, 2)
    a = cache_chain(pool, [1, 2, 3, 4, 5, 6])  # blocks 0 <- 1 <- 2
    b = cache_chain(pool, [7, 8], parent=a[0])  # block 3, child of 0
    assert b == [3]
    pool.incref(a[0])  # b's holder also holds its prefix
    release(pool, [a[0]] + b)  # b released first: 3 is the oldest leaf
    release(pool, a)
    assert pool.last_access(3) < pool.last_access(2) < pool.last_access(1) < pool.last_access(0)
    assert pool.evict(0) == []
    assert pool.evict(2) == [3, 2]
    assert pool.evict(10) == [1, 0]
    assert pool.free_list() == [4, 5, 6, 7, 3, 2, 1, 0]
    assert pool.num_evictions == 4
    pool.check_integrity()


def test_a_parent_with_a_referenced_child_subtree_is_not_evicted():
    pool = BlockPool(4, 1)
    ids = cache_chain(pool, [1, 2, 3])
    pool.decref(ids[2])  # only the tail is released
    assert pool.evict(5) == [ids[2]]
    assert pool.is_cached(ids[0]) and pool.is_cached(ids[1])
    pool.check_integrity()


def test_register_requires_in_use_block_and_parent():
    pool = BlockPool(4, 1)
    [b] = cache_chain(pool, [1])
    pool.decref(b)
    with pytest.raises(ValueError):
        pool.register(2, b"k" * 16, None, [5], NS)  # block 2 is free
    c = pool.allocate()
    with pytest.raises(ValueError):
        pool.register(c, b"k" * 16, b, [5], NS)  # parent has no references


def test_heap_stays_bounded_under_revive_churn():
    pool = BlockPool(2, 1)
    ids = cache_chain(pool, [1, 2])
    release(pool, ids)
    for _ in range(500):
        pool.incref(ids[0])
        pool.incref(ids[1])
        pool.decref(ids[1])
        pool.decref(ids[0])
        pool.evict(0)
        # stale entries are compacted on push, even when nothing is ever evicted
        assert len(pool._heap) <= 4 * pool.num_blocks + 64 + 1
    pool.check_integrity()
    assert pool.evict(5) == [ids[1], ids[0]]


def test_decref_of_unreferenced_block_raises():
    pool = BlockPool(2, 1)
    with pytest.raises(ValueError):
        pool.decref(0)
