"""KVTiers bookkeeping (torch-free): demotion, confirmed promotion, swap, failed steps, write-through
and the load-vs-recompute cost model.  Integrity is checked after every operation."""
from __future__ import annotations

import pytest

from prefix_cache import BlockManager, HostKVPool, KVTiers, LoadCostModel, PrefixHit
from prefix_cache.kv_codec import BlockMeta, DecodedBlock, KVLayout, decode_block, encode_block

BS = 4
LAYOUT = KVLayout("test:kv", "float32", (1, 2, BS, 1, 1))  # 32 bytes a block


class DictStore:
    """An in-memory RemoteKVStore with the real codec (the Redis store has its own tests)."""

    layout = LAYOUT

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}

    def fetch_prefix(self, keys) -> list[DecodedBlock]:
        out = []
        for k in keys:
            if k not in self.values:
                break
            out.append(decode_block(self.values[k], LAYOUT, k))
        return out

    def put(self, meta: BlockMeta, payload) -> bool:
        self.values[meta.key] = encode_block(LAYOUT, meta, payload)
        return True

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float = 5.0) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


def _setup(num_blocks=8, host_slots=8, remote=None):
    blocks = BlockManager(num_blocks, BS)
    tiers = KVTiers(blocks, host=HostKVPool(host_slots) if host_slots else None, remote=remote)
    return blocks, tiers


def _check(blocks, tiers):
    blocks.check_integrity()
    tiers.check_integrity()


def _compute(blocks, tiers, seq_id, prompt):
    """Admit (device hit only), 'compute' the whole prompt, commit, free."""
    tiers.begin_step()
    hit = blocks.match_prefix(prompt)
    assert blocks.allocate(seq_id, len(prompt), hit=hit, token_ids=prompt) is not None
    tiers.take_transfers()
    tiers.end_step(True)
    blocks.commit(seq_id, prompt, len(prompt))
    blocks.free(seq_id)
    _check(blocks, tiers)


PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks reusable (the last token is always computed)


def test_evicted_blocks_are_demoted_then_promoted():
    blocks, tiers = _setup()
    _compute(blocks, tiers, "a", PROMPT)
    tiers.begin_step()
    evicted = blocks.evict(8)
    assert len(evicted) == 3
    moves = tiers.take_transfers()
    assert sorted(b for b, _ in moves.device_to_host) == sorted(evicted)
    tiers.end_step(True)
    _check(blocks, tiers)

    tiers.begin_step()
    hit = blocks.match_prefix(PROMPT)
    assert hit.num_cached_tokens == 0
    load = tiers.extend(PROMPT, None, hit)
    assert load is not None and len(load.host_slots) == 3 and load.num_cached_tokens == 12
    _check(blocks, tiers)  # the slots are pinned for this step
    alloc = blocks.allocate("b", len(PROMPT), hit=load.hit, token_ids=PROMPT)
    assert alloc is not None
    tiers.commit_load(load, blocks.block_ids("b")[:3])
    moves = tiers.take_transfers()
    assert [s for s, _ in moves.host_to_device] == list(load.host_slots)
    assert [b for _, b in moves.host_to_device] == blocks.block_ids("b")[:3]
    tiers.end_step(True)
    _check(blocks, tiers)
    # loaded blocks are private until the sequence commits them; then ordinary cached blocks
    blocks.commit("b", PROMPT, 13)
    blocks.free("b")
    assert blocks.match_prefix(PROMPT).num_cached_tokens == 12
    assert tiers.counters.host_hits == 3 and tiers.counters.loaded_tokens == 12
    _check(blocks, tiers)


def test_a_host_entry_with_other_tokens_is_never_used():
    blocks, tiers = _setup()
    _compute(blocks, tiers, "a", PROMPT)
    tiers.begin_step()
    blocks.evict(8)
    tiers.take_transfers()
    tiers.end_step(True)
    # Same keys, other tokens (what a hash collision would look like): rewrite the host entries.
    keys = blocks.block_keys(PROMPT[:12])
    for k in keys:
        tiers.host.discard(tiers.host.lookup(k))
    tiers.host.insert(keys[0], None, (1, 2, 3, 4), blocks.namespace())
    tiers.begin_step()
    assert tiers.extend(PROMPT, None, PrefixHit.empty(BS)) is None
    tiers.end_step(True)
    _check(blocks, tiers)


def test_a_failed_step_forgets_what_its_transfers_should_have_written():
    blocks, tiers = _setup()
    _compute(blocks, tiers, "a", PROMPT)
    tiers.begin_step()
    blocks.evict(8)
    tiers.take_transfers()
    tiers.end_step(False)  # the demotion copies may not have run
    _check(blocks, tiers)
    assert tiers.host.num_cached == 0
    tiers.begin_step()
    assert tiers.extend(PROMPT, None, PrefixHit.empty(BS)) is None


def test_swap_out_and_in():
    blocks, tiers = _setup(host_slots=4)
    prompt = list(range(200, 210))  # 10 tokens: 2 full blocks + 2 tokens
    tiers.begin_step()
    blocks.allocate("s", 10, token_ids=prompt)
    table = blocks.block_ids("s")
    tiers.take_transfers()
    tiers.end_step(True)
    blocks.commit("s", prompt, 10)
    # preempt with all 10 tokens computed
    tiers.begin_step()
    assert tiers.swap_out("s", table, 10)
    blocks.free("s")
    moves = tiers.take_transfers()
    assert [b for b, _ in moves.device_to_host] == table
    swap_slots = [s for _, s in moves.device_to_host]
    tiers.end_step(True)
    _check(blocks, tiers)
    assert tiers.swapped_tokens("s") == 10 and tiers.host.num_swap == 3
    # resume: the two full blocks are still cached on the device; only the partial one comes back
    tiers.begin_step()
    device = blocks.match_prefix(prompt[:11])
    hit = PrefixHit(device.block_ids, None, 0, BS)
    assert len(hit.block_ids) == 2
    blocks.allocate("s", 11, hit=hit, token_ids=prompt)
    new_table = blocks.block_ids("s")
    tiers.swap_in("s", new_table, 2)
    moves = tiers.take_transfers()
    assert moves.host_to_device == ((swap_slots[2], new_table[2]),)
    _check(blocks, tiers)
    tiers.end_step(True)
    _check(blocks, tiers)
    assert tiers.host.num_swap == 0 and tiers.swapped_tokens("s") is None


def test_swap_needs_room_and_a_failed_step_drops_the_swap():
    blocks, tiers = _setup(host_slots=2)
    tiers.begin_step()
    blocks.allocate("s", 10)
    assert not tiers.swap_out("s", blocks.block_ids("s"), 10)  # 3 blocks, 2 slots
    assert tiers.counters.swap_failures == 1
    assert tiers.swap_out("s", blocks.block_ids("s")[:2], 8)
    tiers.take_transfers()
    tiers.end_step(False)
    _check(blocks, tiers)
    assert tiers.swapped_tokens("s") is None and tiers.host.num_swap == 0


def test_write_through_then_remote_hits():
    store = DictStore()
    blocks, tiers = _setup(host_slots=0, remote=store)
    _compute(blocks, tiers, "a", PROMPT)
    writes = tiers.take_writes()
    assert len(writes) == 3
    tiers.submit_writes(writes, [bytes([i]) * LAYOUT.nbytes for i in range(3)])
    # another replica: empty device pool, same store
    blocks2, tiers2 = _setup(host_slots=0, remote=store)
    tiers2.begin_step()
    load = tiers2.extend(PROMPT, None, PrefixHit.empty(BS))
    assert load is not None and len(load.remote_payloads) == 3
    assert [bytes(p[:1]) for p in load.remote_payloads] == [b"\0", b"\1", b"\2"]
    blocks2.allocate("b", 13, hit=load.hit, token_ids=PROMPT)
    tiers2.commit_load(load, blocks2.block_ids("b")[:3])
    assert len(tiers2.take_transfers().remote_to_device) == 3
    tiers2.end_step(True)
    blocks2.commit("b", PROMPT, 13)
    assert tiers2.take_writes() == []  # loaded from the store: not written back
    _check(blocks2, tiers2)
    # a prompt that diverges after block 1 stops at the first mismatch
    other = PROMPT[:8] + [7, 7, 7, 7, 7]
    blocks3, tiers3 = _setup(host_slots=0, remote=store)
    load = tiers3.extend(other, None, PrefixHit.empty(BS))
    assert load is not None and len(load.remote_payloads) == 2


class RetainingStore(DictStore):
    """DictStore with long retention: entries' least expiry (seconds) and the writer's absent-key reports."""

    def __init__(self) -> None:
        super().__init__()
        self.expiry: dict[bytes, float] = {}
        self.missing: list = []

    def put(self, meta: BlockMeta, payload, *, ttl_s: float | None = None) -> bool:
        if ttl_s is not None:
            self.expiry[meta.key] = max(ttl_s, self.expiry.get(meta.key, 0.0))
        return super().put(meta, payload)

    def retain(self, keys, ttl_s: float) -> bool:
        for k in keys:
            if k in self.values:
                self.expiry[k] = max(ttl_s, self.expiry.get(k, 0.0))
            else:
                self.missing.append((k, ttl_s))
        return True

    def take_missing(self):
        out, self.missing = self.missing, []
        return out

    @property
    def has_missing(self) -> bool:
        return bool(self.missing)


def test_a_long_retention_extends_present_entries_and_writes_absent_ones_from_the_device():
    store = RetainingStore()
    blocks, tiers = _setup(num_blocks=6, host_slots=0, remote=store)
    tiers.begin_step()
    blocks.allocate("a", 13, token_ids=PROMPT)
    tiers.take_transfers()
    tiers.end_step(True)
    blocks.commit("a", PROMPT, 13)
    writes = tiers.take_writes()
    tiers.submit_writes(writes[:1] + writes[2:], [b"\0" * LAYOUT.nbytes] * 2)  # block 1's write was dropped
    chain, _ = blocks.retain_prefix("a", 13, 3600.0)
    assert not tiers.has_pending_retained
    tiers.persist({b: 3600.0 for b in chain})
    assert tiers.has_pending_retained
    assert store.expiry == {writes[0].meta.key: 3600.0, writes[2].meta.key: 3600.0}  # extended, not rewritten
    retained = tiers.take_writes()  # what a step's end (or the idle engine) writes: block 1, with its expiry
    assert [(w.block_id, w.meta, w.ttl_s) for w in retained] == [(chain[1], writes[1].meta, 3600.0)]
    tiers.submit_writes(retained, [b"\1" * LAYOUT.nbytes])
    assert store.expiry[writes[1].meta.key] == 3600.0 and len(store.values) == 3
    blocks.free("a")
    _check(blocks, tiers)
    # absent from the store and evicted from the device before the write: counted as lost, nothing written
    del store.values[writes[2].meta.key]
    tiers.persist({chain[2]: 7200.0})
    blocks.evict(6)
    assert tiers.take_writes() == [] and tiers.stats()["remote_retained_lost"] == 1
    _check(blocks, tiers)


def test_cost_model_decides_from_measurements():
    costs = LoadCostModel(block_size=16, probe_every=4)
    assert costs.worth_loading("remote")  # nothing measured yet: load, and so measure
    costs.record_prefill(seconds=1.0, tokens=1000)  # 1 ms a token: recomputing a block costs 16 ms
    costs.record_load("remote", seconds=0.002, blocks=1)
    assert costs.worth_loading("remote")
    for _ in range(30):  # Redis gets slow: 50 ms a block
        costs.record_load("remote", seconds=0.05, blocks=1)
    assert not costs.prefers_load("remote")
    decisions = [costs.worth_loading("remote") for _ in range(8)]
    assert decisions.count(True) == 2  # probes every 4th decision, so the estimate can recover
    assert costs.worth_loading("host")  # tiers are judged separately
    assert LoadCostModel(16, "always").worth_loading("remote")
    with pytest.raises(ValueError):
        LoadCostModel(16, "never")


def test_blocks_evicted_between_steps_are_demoted_with_the_next_step():
    blocks, tiers = _setup()
    _compute(blocks, tiers, "a", PROMPT)
    blocks.evict(8)  # outside any step
    tiers.begin_step()
    moves = tiers.take_transfers()
    assert len(moves.device_to_host) == 3
    tiers.end_step(True)
    _check(blocks, tiers)
    assert tiers.host.num_cached == 3
    # a step whose transfers were handed out but that never ended counts as failed
    _compute(blocks, tiers, "b", list(range(300, 309)))
    tiers.begin_step()
    blocks.evict(8)
    tiers.take_transfers()
    tiers.begin_step()
    _check(blocks, tiers)
    assert tiers.host.num_cached == 3
