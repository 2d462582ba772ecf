import pytest

from prefix_cache import Allocation, BlockManager, NoFreeBlocksError, PrefixCacheStats, PrefixHit, StaleHitError


def snapshot(m: BlockManager, seq_ids=()):
    return (
        m.usage(),
        m.free_list(),
        {s: m.block_ids(s) for s in seq_ids if m.has_seq(s)},
        [m.ref_count(b) for b in range(m.num_blocks)],
        [m.is_cached(b) for b in range(m.num_blocks)],
        m.stats(),
    )


def admit(m: BlockManager, seq_id, prompt, *, salt=None, extra_tokens=0):
    """match + allocate for the whole prompt, like the scheduler does; returns (hit, allocation)."""
    hit = m.match_prefix(prompt, cache_salt=salt)
    alloc = m.allocate(seq_id, len(prompt) + extra_tokens, hit=hit, cache_salt=salt, token_ids=prompt)
    m.check_integrity()
    return hit, alloc


def run(m: BlockManager, seq_id, prompt, *, salt=None):
    """Admit, 'compute' the whole prompt, commit, release copy sources."""
    hit, alloc = admit(m, seq_id, prompt, salt=salt)
    assert alloc is not None
    m.release_copy_sources()
    m.commit(seq_id, prompt, len(prompt))
    m.check_integrity()
    return hit, alloc


def test_tables_come_from_the_front_of_the_free_list():
    m = BlockManager(8, 4)
    assert m.allocate("a", 10) == Allocation(())
    assert m.allocate("b", 5) == Allocation(())
    assert m.block_ids("a") == [0, 1, 2]
    assert m.block_ids("b") == [3, 4]
    m.check_integrity()
    m.free("a")  # nothing committed: uncached blocks go to the back, tail first
    assert m.free_list() == [5, 6, 7, 2, 1, 0]
    m.check_integrity()
    assert m.usage() == {"num_blocks": 8, "num_free": 6, "num_evictable": 0, "num_in_use": 2, "peak_in_use": 5, "num_retained": 0, "num_retention_expired": 0, "num_retained_evicted": 0}


def test_growth_and_noop_growth():
    m = BlockManager(8, 4)
    m.allocate("a", 3)
    assert m.block_ids("a") == [0]
    assert m.allocate("a", 4) == Allocation(())
    assert m.block_ids("a") == [0]
    m.allocate("a", 9)
    assert m.block_ids("a") == [0, 1, 2]
    assert m.num_blocks_needed("a", 13) == 1
    assert m.num_blocks_needed("a", 2) == 0
    assert m.num_blocks_needed(None, 13) == 4
    m.check_integrity()


def test_commit_then_match_full_blocks():
    m = BlockManager(8, 4)
    prompt = list(range(10))
    run(m, "a", prompt)
    assert [m.is_cached(b) for b in m.block_ids("a")] == [True, True, False]
    hit = m.match_prefix(prompt + [99])
    assert hit == PrefixHit((0, 1), None, 0, 4)
    assert hit.num_cached_tokens == 8


def test_full_prompt_hit_leaves_the_last_token():
    m = BlockManager(8, 4)
    prompt = list(range(8))
    run(m, "a", prompt)
    m.free("a")
    hit = m.match_prefix(prompt)
    assert hit == PrefixHit((0,), 1, 3, 4)
    assert hit.num_cached_tokens == 7
    alloc = m.allocate("b", 8, hit=hit, token_ids=prompt)
    assert alloc == Allocation(((1, 2),))
    assert m.block_ids("b") == [0, 2]
    m.check_integrity()
    # a one-token prompt can never hit
    assert m.match_prefix([0]).num_cached_tokens == 0
    assert m.match_prefix([]).num_cached_tokens == 0


def test_block_size_one_full_hit_leaves_the_last_token():
    m = BlockManager(8, 1)
    run(m, "a", [5, 6, 7])
    hit = m.match_prefix([5, 6, 7])
    assert hit == PrefixHit((0, 1), None, 0, 1)


def test_partial_block_match_copies_on_write():
    m = BlockManager(10, 4)
    run(m, "a", list(range(12)))  # blocks 0,1,2 all cached
    prompt = [0, 1, 2, 3, 4, 5, 100, 101, 102, 103]
    hit = m.match_prefix(prompt)
    assert hit == PrefixHit((0,), 1, 2, 4)
    assert hit.num_cached_tokens == 6
    alloc = m.allocate("b", len(prompt), hit=hit, token_ids=prompt)
    assert alloc.copies == ((1, 3),)
    assert m.block_ids("b") == [0, 3, 4]
    # block 1: a's table + copy protection; block 0: both tables + protection of the source's prefix
    assert m.ref_count(0) == 3 and m.ref_count(1) == 2
    m.check_integrity()
    m.release_copy_sources()
    assert m.ref_count(0) == 2 and m.ref_count(1) == 1
    m.commit("b", prompt, len(prompt))
    m.check_integrity()
    # b's own second block got cached under block 0 next to a's
    assert m.match_prefix(prompt + [7]).block_ids == (0, 3)


def test_partial_match_at_the_root_and_longest_wins():
    m = BlockManager(10, 4)
    run(m, "a", [1, 2, 3, 4, 0])
    run(m, "b", [1, 2, 9, 9, 0])
    run(m, "c", [1, 2, 3, 9, 0])
    hit = m.match_prefix([1, 2, 3, 7, 7, 7])
    assert hit.block_ids == () and hit.partial_tokens == 3
    assert hit.partial_src == 0  # a and c tie on 3 tokens: lowest id
    assert m.match_prefix([1, 2, 9, 5]).partial_src == m.block_ids("b")[0]
    assert m.match_prefix([8, 2, 3, 4, 5]) == PrefixHit.empty(4)


def test_match_is_a_pure_lookup():
    m = BlockManager(8, 4)
    run(m, "a", list(range(9)))
    m.free("a")
    before = snapshot(m)
    m.match_prefix(list(range(9)))
    m.match_prefix(list(range(5)))
    assert snapshot(m) == before


def test_cache_salt_separates_tenants():
    m = BlockManager(12, 4)
    prompt = list(range(9))
    run(m, "a", prompt, salt="tenant-1")
    assert m.match_prefix(prompt, cache_salt="tenant-1").num_cached_tokens == 8
    assert m.match_prefix(prompt, cache_salt="tenant-2") == PrefixHit.empty(4)
    assert m.match_prefix(prompt) == PrefixHit.empty(4)  # no partial match across namespaces either
    run(m, "b", prompt)
    assert m.block_ids("b")[:2] != m.block_ids("a")[:2]


def test_hit_from_another_salt_is_rejected():
    m = BlockManager(12, 4)
    prompt = list(range(9))
    run(m, "a", prompt, salt="tenant-1")
    hit = m.match_prefix(prompt, cache_salt="tenant-1")
    with pytest.raises(StaleHitError):
        m.allocate("b", 9, hit=hit, cache_salt="tenant-2")


def test_extra_keys_separate_models():
    m1 = BlockManager(8, 4, extra_keys=("model-a", "bf16"))
    m1.allocate("a", 8)
    m1.commit("a", list(range(8)), 8)
    m2 = BlockManager(8, 4, extra_keys=("model-b", "bf16"))
    assert m1._pool.index.key_of(0) != m2._ns(None)
    assert m1.match_prefix(list(range(9))).num_cached_tokens == 8


def test_caching_disabled_never_shares():
    m = BlockManager(8, 4, enable_caching=False)
    prompt = list(range(9))
    run(m, "a", prompt)
    assert not any(m.is_cached(b) for b in range(8))
    assert m.match_prefix(prompt) == PrefixHit.empty(4)
    with pytest.raises(ValueError):
        m.allocate("b", 9, hit=PrefixHit((0,), None, 0, 4))
    m.free("a")
    assert m.usage()["num_evictable"] == 0 and m.usage()["num_free"] == 8
    assert m.stats() == PrefixCacheStats(queries=9, hits=0, evictions=0)
    m.check_integrity()


def test_eviction_order_lru_leaves_children_first_and_free_first():
    m = BlockManager(6, 2)
    run(m, "a", [1, 2, 3, 4, 5])  # table [0, 1, 2]; 0=[1,2], 1=[3,4] cached
    hit, _ = run(m, "b", [1, 2, 7, 8, 9])  # table [0, 3, 4]; 3=[7,8] cached under 0
    assert hit.block_ids == (0,) and m.block_ids("b") == [0, 3, 4]
    m.free("b")
    m.free("a")
    assert m.free_list() == [5, 4, 2]
    assert m.usage()["num_evictable"] == 3
    # truly free blocks first, then the LRU leaf (3, released before 1), then 1, then its parent 0
    assert m.allocate("c", 8) is not None
    assert m.block_ids("c") == [5, 4, 2, 3]
    assert m.stats().evictions == 1
    m.check_integrity()
    assert m.evict(5) == [1, 0]
    assert m.stats().evictions == 3
    m.check_integrity()


def test_free_releases_tail_first():
    m = BlockManager(8, 2)
    run(m, "a", [1, 2, 3, 4, 5, 6, 7])  # [0,1,2] cached, 3 partial
    m.free("a")
    assert m.free_list()[-1] == 3
    pool = m._pool
    assert pool.last_access(2) < pool.last_access(1) < pool.last_access(0)
    assert m.evict(3) == [2, 1, 0]


def test_allocate_returning_none_changes_nothing():
    m = BlockManager(4, 4)
    run(m, "a", list(range(9)))  # 3 blocks, 2 cached
    m.free("a")
    m.allocate("x", 4)  # takes the one free block
    prompt = list(range(8)) + [50, 51, 52, 53, 54, 55, 56]
    hit = m.match_prefix(prompt)
    assert hit.block_ids == (0, 1)
    before = snapshot(m, ["x"])
    # needs 2 new blocks but only the 2 evictable ones exist, and the hit revives them
    assert m.num_blocks_needed(None, len(prompt), hit=hit) == 4
    assert not m.can_allocate(4)
    assert m.allocate("y", len(prompt), hit=hit, token_ids=prompt) is None
    assert snapshot(m, ["x"]) == before and not m.has_seq("y")
    assert m.allocate("x", 100) is None
    assert snapshot(m, ["x"]) == before
    m.check_integrity()


def test_can_allocate_is_exact_at_the_boundary():
    m = BlockManager(4, 4)
    run(m, "a", list(range(9)))
    m.free("a")
    prompt = list(range(8)) + [50]
    hit = m.match_prefix(prompt)
    need = m.num_blocks_needed(None, len(prompt), hit=hit)
    assert need == 3  # 1 new block + 2 revived
    assert m.can_allocate(need)
    assert m.allocate("b", len(prompt), hit=hit, token_ids=prompt) is not None
    assert m.block_ids("b") == [0, 1, 3]
    assert m.usage()["num_free"] == 1
    m.check_integrity()


def test_fork_and_copy_on_write():
    m = BlockManager(8, 4)
    prompt = [1, 2, 3, 4, 5, 6]
    run(m, "a", prompt)  # table [0, 1]; 0 cached, 1 partial
    m.fork("a", "b")
    assert m.block_ids("b") == [0, 1]
    assert m.ref_count(0) == 2 and m.ref_count(1) == 2
    m.check_integrity()
    assert m.prepare_write("a", 6) == (1, 2)
    assert m.block_ids("a") == [0, 2] and m.block_ids("b") == [0, 1]
    assert m.ref_count(1) == 2  # b's table + copy protection
    m.check_integrity()
    assert m.prepare_write("a", 7) is None  # already private
    # b is now the only table holding block 1: it writes in place (copies run before the forward)
    assert m.prepare_write("b", 6) is None
    m.release_copy_sources()
    assert m.ref_count(1) == 1
    m.check_integrity()
    with pytest.raises(ValueError):
        m.prepare_write("a", 2)  # block 0 is cached: immutable
    with pytest.raises(IndexError):
        m.prepare_write("a", 8)
    with pytest.raises(ValueError):
        m.fork("a", "b")


def test_copy_on_write_raises_without_blocks():
    m = BlockManager(2, 4)
    m.allocate("a", 6)
    m.fork("a", "b")
    with pytest.raises(NoFreeBlocksError):
        m.prepare_write("a", 6)
    m.check_integrity()


def test_n_samples_hold_the_prompt_once():
    m = BlockManager(16, 4)
    prompt = list(range(10))
    run(m, "s0", prompt)
    for i in range(1, 4):
        m.fork("s0", f"s{i}")
    assert m.usage()["num_in_use"] == 3
    for i in range(4):
        m.allocate(f"s{i}", 11)
        m.prepare_write(f"s{i}", 10)
    m.release_copy_sources()
    m.check_integrity()
    # two shared full blocks, and each sample has its own last block
    assert m.usage()["num_in_use"] == 2 + 4
    assert len({m.block_ids(f"s{i}")[2] for i in range(4)}) == 4


def test_copy_source_is_protected_until_released():
    m = BlockManager(4, 4)
    prompt = list(range(8))
    run(m, "a", prompt)
    m.free("a")
    _, alloc = admit(m, "b", prompt)
    assert alloc.copies == ((1, 2),)
    m.free("b")  # e.g. preempted before the forward ran
    m.check_integrity()
    # the source and its ancestor stay referenced: nothing evictable
    assert m.usage()["num_evictable"] == 0
    assert m.evict(4) == []
    m.release_copy_sources()
    m.check_integrity()
    assert m.evict(4) == [1, 0]


def test_duplicate_commit_keeps_table_and_anchors_the_cached_twin():
    m = BlockManager(12, 2)
    prompt = [1, 2, 3, 4, 5]
    admit(m, "a", prompt)
    admit(m, "b", prompt)  # admitted before a committed: no hit, own blocks
    assert m.block_ids("a") == [0, 1, 2] and m.block_ids("b") == [3, 4, 5]
    m.commit("a", prompt, 5)
    m.commit("b", prompt, 5)
    m.check_integrity()
    assert m.block_ids("b") == [3, 4, 5]
    assert not m.is_cached(3) and not m.is_cached(4)
    assert m.ref_count(0) == 2 and m.ref_count(1) == 2  # a's table + b's anchors
    # b's continuation is cached under a's blocks
    tokens = prompt + [6, 7, 8]
    m.allocate("b", 8)
    m.commit("b", tokens, 8)
    m.check_integrity()
    assert m.match_prefix(tokens + [0]).block_ids == (0, 1, 5, 6)
    m.free("a")
    m.check_integrity()
    assert m.usage()["num_evictable"] == 0  # b still holds the whole cached chain
    m.free("b")
    m.check_integrity()
    assert m.usage() == {"num_blocks": 12, "num_free": 8, "num_evictable": 4, "num_in_use": 0, "peak_in_use": 7, "num_retained": 0, "num_retention_expired": 0, "num_retained_evicted": 0}


def test_recomputed_last_block_of_a_full_hit_anchors_and_keeps_caching():
    m = BlockManager(12, 4)
    prompt = list(range(8))
    run(m, "a", prompt)
    m.free("a")
    hit, alloc = run(m, "b", prompt)
    assert alloc.copies == ((1, 2),) and m.block_ids("b") == [0, 2]
    assert not m.is_cached(2)
    tokens = prompt + [8, 9, 10, 11]
    m.allocate("b", 12)
    m.commit("b", tokens, 12)
    assert m.match_prefix(tokens + [0]).block_ids == (0, 1, 3)
    m.check_integrity()


def test_stale_hit_is_rejected_without_side_effects():
    m = BlockManager(3, 2)
    run(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    hit = m.match_prefix([1, 2, 3, 4, 9])
    assert hit.block_ids == (0, 1)
    m.allocate("x", 6)  # evicts both cached blocks
    before = snapshot(m, ["x"])
    with pytest.raises(StaleHitError):
        m.allocate("y", 5, hit=hit)
    assert snapshot(m, ["x"]) == before


def test_hit_must_match_token_ids_and_leave_a_token():
    m = BlockManager(8, 2)
    run(m, "a", [1, 2, 3, 4, 5])
    hit = m.match_prefix([1, 2, 3, 4, 5])
    with pytest.raises(StaleHitError):
        m.allocate("b", 5, hit=hit, token_ids=[1, 2, 3, 9, 5])
    with pytest.raises(ValueError):
        m.allocate("b", 4, hit=hit, token_ids=[1, 2, 3, 4])
    with pytest.raises(ValueError):
        m.allocate("b", 3, hit=hit)  # fewer tokens than the hit covers
    with pytest.raises(ValueError):
        m.allocate("a", 8, hit=hit)  # a hit only at admission
    assert not m.has_seq("b")
    m.check_integrity()


def test_hash_collision_never_serves_or_corrupts(monkeypatch):
    import prefix_cache.manager as manager_mod
    from prefix_cache.hashing import block_key_encoded as real

    # A degenerate hash that ignores tokens: every block at the same depth collides.
    monkeypatch.setattr(manager_mod, "block_key_encoded", lambda parent, tokens, ns: real(parent, [], ns))
    m = BlockManager(8, 2)
    run(m, "a", [1, 2, 3, 4, 5])
    hit = m.match_prefix([7, 8, 9, 9, 5])
    assert hit == PrefixHit.empty(2)
    run(m, "b", [7, 8, 9, 9, 5])  # commit sees the collision: b is simply not cached
    assert not any(m.is_cached(b) for b in m.block_ids("b"))
    assert m.match_prefix([1, 2, 3, 4, 5]).block_ids == (0, 1)
    m.check_integrity()


def test_stats_and_usage():
    m = BlockManager(8, 4)
    prompt = list(range(10))
    run(m, "a", prompt)
    run(m, "b", prompt)
    s = m.stats()
    assert (s.queries, s.hits) == (20, 8)
    assert s.hit_rate == pytest.approx(0.4)
    assert PrefixCacheStats(0, 0, 0).hit_rate == 0.0
    u = m.usage()
    assert u["num_in_use"] == 4 and u["peak_in_use"] == 4
    m.free("a")
    m.free("b")
    assert m.usage()["peak_in_use"] == 4
    assert m.usage()["num_in_use"] == 0


def test_commit_validation_and_unknown_sequences():
    m = BlockManager(4, 2)
    m.allocate("a", 3)
    with pytest.raises(ValueError):
        m.commit("a", [1, 2, 3], 4)
    with pytest.raises(ValueError):
        m.commit("a", [1, 2, 3, 4, 5], 5)  # past the block table
    with pytest.raises(KeyError):
        m.free("nope")
    with pytest.raises(KeyError):
        m.commit("nope", [], 0)
    m.commit("a", [1, 2, 3], 3)
    m.commit("a", [1, 2, 3], 2)  # idempotent / never goes backwards
    assert m.is_cached(0) and not m.is_cached(1)
    m.check_integrity()


def test_prefix_hit_validation():
    with pytest.raises(ValueError):
        PrefixHit((), 3, 0, 4)
    with pytest.raises(ValueError):
        PrefixHit((), None, 2, 4)
    with pytest.raises(ValueError):
        PrefixHit((), 1, 4, 4)
    assert PrefixHit((1, 2), 3, 2, 4).num_cached_tokens == 10


def test_block_keys_match_what_commit_caches():
    from prefix_cache import BlockManager

    mgr = BlockManager(8, 4)
    tokens = list(range(10))
    keys = mgr.block_keys(tokens, cache_salt="t")
    assert len(keys) == 2
    assert mgr.allocate("s", 10, hit=mgr.match_prefix(tokens, cache_salt="t"), cache_salt="t", token_ids=tokens)
    mgr.commit("s", tokens, 10)
    hit = mgr.match_prefix(tokens + [99], cache_salt="t")
    assert len(hit.block_ids) == 2
    assert mgr.block_keys(tokens) != keys  # another tenant, other keys
    assert BlockManager(8, 4, enable_caching=False).block_keys(tokens) == []
    mgr.free("s")
    mgr.check_integrity()
