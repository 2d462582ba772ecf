"""Property-based tests: random operation sequences against a model of the KV contents.

The machine keeps a fake KV pool: ``kv[block][slot]`` holds the token prefix whose KV the slot
stores (what a real forward would write there).  Fresh blocks are filled with garbage.  Like the
engine, a step is scheduled first (allocate, ``prepare_write``; copies are queued) and run later
(queued copies, then KV writes, then ``commit`` and ``release_copy_sources``); admissions,
aborts, evictions and memory pressure may happen in between.  After every operation each
sequence must read exactly its own prefix through its block table (queued copies applied),
which catches wrong sharing, missing copy-on-write, eviction of a referenced block or of an
unprotected copy source, and hits that serve the wrong KV, on top of ``check_integrity``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import prefix_cache.manager as manager_mod
from prefix_cache import BlockManager, NoFreeBlocksError, PrefixHit
from prefix_cache.hashing import block_key_encoded

TOKENS = st.integers(0, 3)  # a tiny vocabulary makes shared prefixes and partial matches common
GARBAGE = ("garbage",)


@dataclass
class Seq:
    tokens: list[int]
    computed: int
    salt: str | None


class PrefixCacheMachine(RuleBasedStateMachine):
    # With COLLIDE the hash ignores all but the first token of each block, so most keys collide
    # and only the token confirmation keeps sharing correct.
    COLLIDE = False

    def __init__(self) -> None:
        super().__init__()
        self._saved_hash = manager_mod.block_key_encoded
        if self.COLLIDE:
            manager_mod.block_key_encoded = lambda parent, tokens, ns: block_key_encoded(parent, tokens[:1], ns)
        self.seqs: dict[int, Seq] = {}
        self.next_id = 0
        self.pending: list[tuple[int, int]] = []
        self.scheduled: dict[int, int] = {}  # seq -> target computed tokens of the next forward

    def teardown(self) -> None:
        manager_mod.block_key_encoded = self._saved_hash

    @initialize(
        num_blocks=st.integers(3, 32),
        block_size=st.integers(1, 4),
        caching=st.sampled_from([True, True, True, False]),
        documents=st.lists(st.lists(TOKENS, min_size=4, max_size=16), min_size=1, max_size=3),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool, documents: list[list[int]]) -> None:
        self.m = BlockManager(num_blocks, block_size, enable_caching=caching, extra_keys=("model", "fp16"))
        self.bs = block_size
        self.kv: list[list[tuple]] = [[GARBAGE] * block_size for _ in range(num_blocks)]
        # Prompts mostly start with one of a few shared "documents" (system prompt, RAG
        # context) or re-send an earlier sequence (next chat turn), so hits are common.
        self.documents = documents
        self.history: list[list[int]] = []

    # ---- helpers -----------------------------------------------------------------------------
    def tables(self) -> dict[int, list[int]]:
        return {sid: self.m.block_ids(sid) for sid in self.seqs}

    def snapshot(self):
        m = self.m
        return (
            m.usage(),
            m.free_list(),
            self.tables(),
            [m.ref_count(b) for b in range(m.num_blocks)],
            [m.is_cached(b) for b in range(m.num_blocks)],
            m.stats(),
        )

    def scramble(self, blocks) -> None:
        for b in blocks:
            self.kv[b] = [GARBAGE] * self.bs

    def copy(self, copies) -> None:
        # Like the engine: copies are queued and run just before the next forward, so the
        # manager must keep their sources intact (protected) until release_copy_sources().
        self.pending.extend(copies)

    def flush(self) -> None:
        """The runner performs the queued copies (before the forward), then sources are released."""
        for src, dst in self.pending:
            self.kv[dst] = list(self.kv[src])
        self.pending.clear()
        self.m.release_copy_sources()

    def view(self) -> list[list[tuple]]:
        """KV as a sequence will read it in the next forward: queued copies applied."""
        kv = list(self.kv)
        for src, dst in self.pending:
            kv[dst] = list(kv[src])
        return kv

    def check_seq_kv(self, sid: int) -> None:
        s = self.seqs[sid]
        table = self.m.block_ids(sid)
        assert len(table) * self.bs >= s.computed
        kv = self.view()
        for p in range(s.computed):
            assert kv[table[p // self.bs]][p % self.bs] == tuple(s.tokens[: p + 1]), (sid, p)

    def check_hit(self, hit: PrefixHit, prompt: list[int]) -> None:
        bs = self.bs
        index = self.m._pool.index
        kv = self.view()
        assert hit.num_cached_tokens <= max(len(prompt) - 1, 0)
        if not self.m.enable_caching:
            assert hit == PrefixHit.empty(bs)
        for i, b in enumerate(hit.block_ids):
            assert index.tokens_of(b) == tuple(prompt[i * bs : (i + 1) * bs])
            assert kv[b] == [tuple(prompt[: i * bs + j + 1]) for j in range(bs)]
        if hit.partial_src is not None:
            start, n = len(hit.block_ids) * bs, hit.partial_tokens
            assert index.tokens_of(hit.partial_src)[:n] == tuple(prompt[start : start + n])
            assert kv[hit.partial_src][:n] == [tuple(prompt[: start + j + 1]) for j in range(n)]

    def others_unchanged(self, before: dict[int, list[int]], sid: int | None) -> None:
        after = self.tables()
        for other, table in before.items():
            if other != sid and other in after:
                assert after[other] == table

    # ---- operations --------------------------------------------------------------------------
    @rule(
        data=st.data(),
        suffix=st.one_of(st.just([]), st.lists(TOKENS, max_size=6)),
        salt=st.sampled_from([None, None, "tenant"]),
        chunk=st.integers(1, 12),
        run_now=st.booleans(),
    )
    def admit(self, data, suffix: list[int], salt: str | None, chunk: int, run_now: bool) -> None:
        """Admission; with run_now the first chunk is computed at once (admit + forward)."""
        source = data.draw(st.sampled_from(self.documents + self.history))
        cut = data.draw(st.one_of(st.just(len(source)), st.integers(0, len(source))))
        prompt = source[:cut] + suffix
        if not prompt:
            return
        sid = self._admit(prompt, salt, chunk)
        if sid is not None and run_now:
            self._compute(sid, chunk)
            self.forward()

    def _admit(self, prompt: list[int], salt: str | None, chunk: int) -> int | None:
        m = self.m
        hit = m.match_prefix(prompt, cache_salt=salt)
        self.check_hit(hit, prompt)
        event(f"admit: full hit blocks={min(len(hit.block_ids), 2)} partial={hit.partial_src is not None}")
        num_tokens = min(len(prompt), hit.num_cached_tokens + chunk)
        ok = m.can_allocate(m.num_blocks_needed(None, num_tokens, hit=hit))
        before, tables = self.snapshot(), self.tables()
        sid = self.next_id
        alloc = m.allocate(sid, num_tokens, hit=hit, cache_salt=salt, token_ids=prompt)
        assert (alloc is not None) == ok
        if alloc is None:
            event("admit: no room")
            assert self.snapshot() == before
            return None
        self.next_id += 1
        table = m.block_ids(sid)
        assert table[: len(hit.block_ids)] == list(hit.block_ids)
        self.scramble(table[len(hit.block_ids) :])
        self.copy(alloc.copies)
        self.seqs[sid] = Seq(list(prompt), hit.num_cached_tokens, salt)
        self.check_seq_kv(sid)
        self.others_unchanged(tables, sid)
        return sid

    def runnable(self) -> list[int]:
        return sorted(i for i, s in self.seqs.items() if s.computed < len(s.tokens) and i not in self.scheduled)

    @precondition(lambda self: self.runnable())
    @rule(data=st.data(), k=st.integers(1, 6), defer=st.booleans())
    def compute(self, data, k: int, defer: bool) -> None:
        """Schedule k more tokens of a sequence; unless deferred, run the forward right away."""
        self._compute(data.draw(st.sampled_from(self.runnable())), k)
        if not defer:
            self.forward()

    def _compute(self, sid: int, k: int) -> None:
        """Scheduler side of a step for one sequence: grow the table, copy-on-write."""
        m = self.m
        s = self.seqs[sid]
        target = min(len(s.tokens), s.computed + k)
        before, tables = self.snapshot(), self.tables()
        old_table = m.block_ids(sid)
        if m.allocate(sid, target) is None:
            assert not m.can_allocate(m.num_blocks_needed(sid, target))
            assert self.snapshot() == before
            return
        self.scramble(m.block_ids(sid)[len(old_table) :])
        for p in range(s.computed, target):
            try:
                copy = m.prepare_write(sid, p)
            except NoFreeBlocksError:
                assert not m.can_allocate(1)
                return  # not scheduled this step; copies made so far stay queued and valid
            if copy is not None:
                event("copy-on-write")
                src, dst = copy
                self.scramble([dst])
                self.copy([copy])
                assert m.block_ids(sid)[p // self.bs] == dst
        self.others_unchanged(tables, sid)
        self.scheduled[sid] = target

    def forward(self) -> None:
        """Runner side: queued copies, then every scheduled sequence writes its KV; then commit."""
        m = self.m
        self.flush()
        scheduled, self.scheduled = self.scheduled, {}
        all_tables = self.tables()
        for sid, target in scheduled.items():
            s = self.seqs[sid]
            table = all_tables[sid]
            for p in range(s.computed, target):
                b = table[p // self.bs]
                assert not m.is_cached(b), "a write into a cached block would corrupt shared KV"
                assert all(b not in t for o, t in all_tables.items() if o != sid), "write into a shared block"
                self.kv[b][p % self.bs] = tuple(s.tokens[: p + 1])
        for sid, target in scheduled.items():
            s = self.seqs[sid]
            m.commit(sid, s.tokens, target)
            s.computed = target
            if target == len(s.tokens):
                self.history.append(list(s.tokens))
            if m._seqs[sid].anchors:
                event("commit: anchored duplicate")
            if m._seqs[sid].chain_broken:
                event("commit: collision")
            if m.enable_caching and not self.COLLIDE:
                # match after commit returns what was committed (held blocks cannot be evicted)
                hit = m.match_prefix(s.tokens[:target] + [0], cache_salt=s.salt)
                assert len(hit.block_ids) == target // self.bs
                self.check_hit(hit, s.tokens[:target] + [0])

    @precondition(lambda self: any(s.computed == len(s.tokens) for s in self.seqs.values()))
    @rule(data=st.data(), token=TOKENS)
    def append_token(self, data, token: int) -> None:
        """Sample a token; usually decode it right away (its KV is written by the next forward)."""
        sid = data.draw(st.sampled_from(sorted(i for i, s in self.seqs.items() if s.computed == len(s.tokens))))
        self.seqs[sid].tokens.append(token)
        if data.draw(st.booleans()):
            self._compute(sid, 1)
            self.forward()

    # Forks happen after a step's forward, never between scheduling and running it.
    @precondition(lambda self: self.seqs and not self.scheduled)
    @rule(data=st.data())
    def fork(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        before = self.snapshot()
        child = self.next_id
        self.next_id += 1
        self.m.fork(sid, child)
        s = self.seqs[sid]
        self.seqs[child] = Seq(list(s.tokens), s.computed, s.salt)
        assert self.m.block_ids(child) == self.m.block_ids(sid)
        assert self.m.usage()["num_free"] == before[0]["num_free"]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tables = self.tables()
        self.m.free(sid)  # abort / preemption, possibly between scheduling and the forward
        del self.seqs[sid]
        self.scheduled.pop(sid, None)
        assert not self.m.has_seq(sid)
        self.others_unchanged(tables, sid)

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        m = self.m
        pool = m._pool
        index = pool.index
        cached = set(index.block_ids())
        parents = {b: index.parent_of(b) for b in cached}
        refs = [m.ref_count(b) for b in range(m.num_blocks)]
        num_evictable = m.usage()["num_evictable"]
        tables = self.tables()
        evicted = m.evict(n)
        event(f"evicted {len(evicted)}")
        assert len(evicted) == min(n, num_evictable)
        for b in evicted:
            assert b in cached and refs[b] == 0, "only unreferenced cached blocks are evicted"
            # a leaf at that moment: no still-cached child
            assert all(parents[c] != b for c in cached), "a parent was evicted before its child"
            leaves = [c for c in cached if refs[c] == 0 and all(parents[d] != c for d in cached)]
            assert pool.last_access(b) == min(pool.last_access(c) for c in leaves), "not the LRU leaf"
            cached.remove(b)
        self.scramble(evicted)  # their KV may be overwritten from now on
        self.others_unchanged(tables, None)

    @rule(n=st.integers(1, 24))
    def hog(self, n: int) -> None:
        """A sequence with no prompt grabs up to n blocks: memory pressure that evicts."""
        m = self.m
        n = min(n, m.num_free_blocks())
        tables = self.tables()
        sid = self.next_id
        if n == 0 or m.allocate(sid, n * self.bs) is None:
            return
        self.next_id += 1
        self.seqs[sid] = Seq([], 0, None)
        self.scramble(m.block_ids(sid))
        self.others_unchanged(tables, sid)

    @rule()
    def run_forward(self) -> None:
        self.forward()

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()
        u = self.m.usage()
        assert u["num_free"] + u["num_evictable"] + u["num_in_use"] == u["num_blocks"]
        free = set(self.m.free_list())
        for sid in self.seqs:
            assert not free & set(self.m.block_ids(sid))
            self.check_seq_kv(sid)


class CollidingHashMachine(PrefixCacheMachine):
    COLLIDE = True


_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = _SETTINGS
TestCollidingHashMachine = CollidingHashMachine.TestCase
TestCollidingHashMachine.settings = settings(_SETTINGS, max_examples=100)
