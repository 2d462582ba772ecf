"""Retention (issue 39): an eviction order, not a pin. Retained evictable leaves go after every other evictable
leaf, retention expires by TTL, a cap lapses the retention that expires first, and nothing is ever refused."""
import random

import pytest

from prefix_cache import BlockManager, BlockPool, NoFreeBlocksError

from pool_testlib import cache_chain, release


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_retained_chain_is_evicted_after_every_other_even_if_older():
    clock = Clock()
    pool = BlockPool(6, 2, clock=clock)
    old = cache_chain(pool, [1, 2, 3, 4])  # used first: LRU would evict it first
    new = cache_chain(pool, [5, 6, 7, 8])
    release(pool, old)
    release(pool, new)
    for b in old:
        pool.retain(b, clock.now + 60)
        pool.check_integrity()
    assert pool.num_retained == 2
    assert pool.evict(2) == [new[1], new[0]]  # the newer, unretained chain goes first, leaf first
    pool.check_integrity()
    assert pool.evict(2) == [old[1], old[0]]  # then the retained one: never a pin
    assert pool.num_retained_evicted == 2 and pool.num_retained == 0
    pool.check_integrity()


def test_retention_expires_by_ttl_and_then_lru_decides():
    clock = Clock()
    pool = BlockPool(4, 2, clock=clock)
    a = cache_chain(pool, [1, 2])
    b = cache_chain(pool, [3, 4])
    release(pool, a)
    release(pool, b)
    pool.retain(a[0], clock.now + 5)
    assert pool.is_retained(a[0])
    clock.now += 6
    assert not pool.is_retained(a[0]) and pool.num_retention_expired == 1
    pool.check_integrity()
    assert pool.evict(1) == a  # least recently used again
    pool.check_integrity()


def test_the_cap_lapses_the_retention_that_expires_first():
    clock = Clock()
    pool = BlockPool(6, 2, max_retained=2, clock=clock)
    chains = [cache_chain(pool, [10 * i, 10 * i + 1]) for i in range(3)]
    for i, chain in enumerate(chains):
        release(pool, chain)
        pool.retain(chain[0], clock.now + 100 + i)
        pool.check_integrity()
    assert [pool.is_retained(c[0]) for c in chains] == [False, True, True]
    assert pool.num_retention_expired == 1
    with pytest.raises(ValueError, match="max_retained"):
        BlockPool(4, 2, max_retained=5)


def test_retention_never_refuses_an_allocation():
    clock = Clock()
    pool = BlockPool(3, 2, clock=clock)
    chain = cache_chain(pool, [1, 2, 3, 4, 5, 6])
    release(pool, chain)
    for b in chain:
        pool.retain(b, clock.now + 3600)
    assert [pool.allocate() for _ in range(3)] == [chain[2], chain[1], chain[0]]
    pool.check_integrity()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_release_ends_retention_and_a_later_until_extends_it():
    clock = Clock()
    pool = BlockPool(4, 2, clock=clock)
    a = cache_chain(pool, [1, 2])
    b = cache_chain(pool, [3, 4])
    release(pool, b)
    release(pool, a)  # a is now the most recently used
    pool.retain(b[0], clock.now + 5)
    pool.retain(b[0], clock.now + 50)  # extended
    pool.retain(b[0], clock.now + 1)  # earlier: no change
    clock.now += 10
    assert pool.is_retained(b[0])
    assert pool.evict(1) == a
    pool.release(b[0])
    pool.check_integrity()
    assert not pool.is_retained(b[0]) and pool.evict(1) == b
    with pytest.raises(ValueError, match="not cached"):
        pool.retain(b[0], clock.now + 5)


def test_random_operations_keep_every_invariant():
    """Allocate, cache, release, retain, release retention, advance time and evict at random."""
    rng = random.Random(0)
    clock = Clock()
    pool = BlockPool(12, 2, max_retained=5, clock=clock)
    held: list[list[int]] = []
    for step in range(600):
        op = rng.random()
        if op < 0.3 and pool.num_available >= 2:
            held.append(cache_chain(pool, [rng.randrange(4), step, rng.randrange(3), step + 1]))
        elif op < 0.5 and held:
            release(pool, held.pop(rng.randrange(len(held))))
        elif op < 0.7:
            cached = [b for b in range(pool.num_blocks) if pool.is_cached(b)]
            if cached:
                pool.retain(rng.choice(cached), clock.now + rng.uniform(1, 30))
        elif op < 0.8:
            pool.release(rng.randrange(pool.num_blocks))
        elif op < 0.9:
            clock.now += rng.uniform(0, 10)
        else:
            pool.evict(rng.randrange(3))
        pool.check_integrity()
        assert pool.num_retained <= 5


def test_the_manager_retains_a_sequences_chain_and_a_warmed_prefix():
    clock = Clock()
    mgr = BlockManager(8, 4, max_retained_blocks=6, clock=clock)
    prompt = list(range(10))
    mgr.allocate("a", len(prompt), hit=mgr.match_prefix(prompt), token_ids=prompt)
    mgr.commit("a", prompt, len(prompt))
    chain, new = mgr.retain_prefix("a", 9, ttl_s=30)
    assert len(chain) == 2 and new == 2
    assert mgr.retain_prefix("a", 9, ttl_s=30) == (chain, 0)  # already retained: nothing new
    mgr.free("a")
    mgr.check_integrity()
    assert mgr.usage()["num_retained"] == 2
    # other traffic fills the pool: the retained chain stays while anything else can go
    other = [100 + t for t in range(24)]
    mgr.allocate("b", len(other), hit=mgr.match_prefix(other), token_ids=other)
    mgr.commit("b", other, len(other))
    mgr.free("b")
    mgr.allocate("c", 24, hit=mgr.match_prefix([200 + t for t in range(24)]))
    mgr.check_integrity()
    assert all(mgr.is_cached(b) and mgr.is_retained(b) for b in chain)
    assert mgr.match_prefix(prompt).num_cached_tokens == 8
    mgr.free("c")
    assert mgr.release_tokens(prompt) == 2 and mgr.usage()["num_retained"] == 0
    assert mgr.retain_tokens(prompt + [99], ttl_s=5) == (chain, 2)
    clock.now += 6
    assert mgr.usage()["num_retained"] == 0
    mgr.check_integrity()
