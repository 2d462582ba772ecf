"""BlockManager: the one owner of KV block ids for the engine.

The scheduler owns no block ids itself.  Per step it asks the manager:

    hit = mgr.match_prefix(prompt, cache_salt=salt)                  # pure lookup
    n = mgr.num_blocks_needed(None, hit.num_cached_tokens + chunk, hit=hit)
    if mgr.can_allocate(n):
        alloc = mgr.allocate(seq, hit.num_cached_tokens + chunk, hit=hit,
                             cache_salt=salt, token_ids=prompt)     # copies to run before forward
    ...
    mgr.prepare_write(seq, position)    # copy-on-write of a block shared by forks, if needed
    # runner: perform every returned copy, then the forward
    mgr.release_copy_sources()
    mgr.commit(seq, all_tokens, num_computed_tokens)                 # cache newly full blocks
    mgr.free(seq)                                                    # finished / preempted

Call ``allocate`` right after ``match_prefix`` for the same request: allocating for another
sequence in between may evict the blocks of the hit (then ``allocate`` raises StaleHitError).

Reference counts.  A block's ref_count is the number of times it appears in sequence tables,
plus one per pending copy-source protection, plus one per *anchor*.  An anchor arises when a
sequence commits a block that is already cached under another id (the same tokens computed
twice, e.g. the last block of a block-aligned prompt that was a full hit and got recomputed):
the sequence keeps its own copy in its table (the duplicate stays uncached and is freed
normally), and additionally holds a reference to the cached twin so that its later blocks can
still be cached as children of that twin.  This keeps "whoever holds a cached block holds its
whole cached prefix", which is what makes every ref-0 cached block really evictable.

Cached blocks are immutable: ``prepare_write`` into a cached block raises, because it would
change KV that other sequences may be served from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .block_pool import BlockPool, NoFreeBlocksError
from .hashing import BlockKey, block_key_encoded, encode_extra_keys
from .interface import Allocation, BlockListener, PrefixCacheStats, PrefixHit, StaleHitError


@dataclass(slots=True)
class _SeqState:
    table: list[int]
    ns: bytes  # encoded extra keys including the cache_salt: the hash namespace of this seq
    # Full blocks already processed by commit (cached, shared from a hit, or anchored).
    num_committed: int = 0
    # table position -> cached twin held as an anchor (table[pos] is an uncached duplicate)
    anchors: dict[int, int] = field(default_factory=dict)
    # Set after a hash collision: nothing of this sequence is cached from then on.
    chain_broken: bool = False

    def canonical(self, pos: int) -> int:
        """The cached block standing for this seq's block ``pos`` in the radix tree."""
        return self.anchors.get(pos, self.table[pos])


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class BlockManager:
    """Block tables, reference counts, prefix caching and copy-on-write for all sequences.

    Invariants (checked by ``check_integrity``):
      * free + evictable + in_use == num_blocks; no block is both free and referenced;
      * each block's ref_count == its occurrences in sequence tables + pending copy
        protections + anchors;
      * a cached block's parent is cached; evictable blocks are cached with ref_count 0;
      * a block with ref_count > 0 is never evicted; children are evicted before parents;
      * each sequence's committed blocks form a chain of cached blocks from its namespace root.
    ``allocate`` returning None changes nothing.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        extra_keys: tuple = (),
        max_retained_blocks: int | None = None,
        clock=None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.extra_keys = tuple(extra_keys)
        self._base_ns = encode_extra_keys(self.extra_keys)  # validates the extra keys early
        self._pool = BlockPool(num_blocks, block_size, max_retained=max_retained_blocks,
                               **({"clock": clock} if clock is not None else {}))
        self._seqs: dict[Hashable, _SeqState] = {}
        # One entry per protection reference; a block protected twice appears twice.
        self._protected: list[int] = []
        self._protect_counts: Counter[int] = Counter()
        self._queries = 0
        self._hits = 0
        self._listeners: list[BlockListener] = []

    def add_listener(self, listener: BlockListener) -> None:
        """Also report newly cached and evicted full blocks to ``listener`` (see BlockListener), after
        the listeners added before it (the KV tiers, KV events)."""
        self._listeners.append(listener)
        listeners = tuple(self._listeners)

        def evicted(*block) -> None:
            for each in listeners:
                each.block_evicted(*block)

        self._pool.on_evict = evicted

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache): only when no sequence holds a block,
        so nothing in use loses its cache entry; returns whether it did. Cleared blocks go straight
        to the free list: listeners are not told of each (they are not evictions to demote)."""
        if self._pool.num_in_use:
            return False
        self._pool.clear_cached()
        return True

    def namespace(self, cache_salt: str | None = None) -> bytes:
        """The hash namespace of blocks cached with this salt (encoded extra keys)."""
        return self._ns(cache_salt)

    # ---- helpers -----------------------------------------------------------------------------
    def _ns(self, cache_salt: str | None) -> bytes:
        if cache_salt is None:
            return self._base_ns
        return encode_extra_keys(self.extra_keys + (("cache_salt", cache_salt),))

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _protect_chain(self, block_id: int) -> None:
        # Protecting a cached block protects its ancestors too: a protected block outliving the
        # sequence that shared its prefix must not leave ref-0 ancestors that look evictable
        # but are not (a parent is never evicted before its children).
        index = self._pool.index
        b: int | None = block_id
        while b is not None:
            self._pool.incref(b)
            self._protected.append(b)
            self._protect_counts[b] += 1
            b = index.parent_of(b) if b in index else None

    def _hit_revivals(self, hit: PrefixHit) -> int:
        """Evictable blocks the hit would revive; they stop counting as available."""
        blocks = list(hit.block_ids)
        if hit.partial_src is not None:
            blocks.append(hit.partial_src)
        return sum(1 for b in blocks if self._pool.is_evictable(b))

    def _validate_hit(self, hit: PrefixHit, ns: bytes, token_ids: Sequence[int] | None) -> None:
        bs = self.block_size
        if hit.block_size != bs:
            raise ValueError(f"hit was made for block_size {hit.block_size}, manager uses {bs}")
        if not self.enable_caching and (hit.block_ids or hit.partial_src is not None):
            raise ValueError("prefix caching is disabled; only an empty hit is valid")
        index = self._pool.index
        parent: int | None = None
        for i, b in enumerate(hit.block_ids):
            if (
                b not in index
                or index.parent_of(b) != parent
                or index.ns_of(b) != ns
                or (token_ids is not None and index.tokens_of(b) != tuple(token_ids[i * bs : (i + 1) * bs]))
            ):
                raise StaleHitError(f"hit block {b} at position {i} is no longer cached as matched")
            parent = b
        src = hit.partial_src
        if src is not None:
            start = len(hit.block_ids) * bs
            n = hit.partial_tokens
            if (
                src not in index
                or index.parent_of(src) != parent
                or index.ns_of(src) != ns
                or (token_ids is not None and index.tokens_of(src)[:n] != tuple(token_ids[start : start + n]))
            ):
                raise StaleHitError(f"partial source block {src} is no longer cached as matched")
        if token_ids is not None and hit.num_cached_tokens > max(len(token_ids) - 1, 0):
            raise ValueError("a hit must leave at least the last prompt token to compute")

    # ---- lookup ------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> PrefixHit:
        """Longest cached prefix of ``token_ids``: full blocks, then a partial block.

        Never covers more than ``len(token_ids) - 1`` tokens: the last prompt token is always
        recomputed because its logits are needed.  Pure lookup: takes no references and leaves
        LRU state alone.  Ties in the partial match go to the lowest block id.
        """
        bs = self.block_size
        limit = len(token_ids) - 1
        if not self.enable_caching or limit <= 0:
            return PrefixHit.empty(bs)
        ns = self._ns(cache_salt)
        index = self._pool.index
        matched: list[int] = []
        parent: int | None = None
        parent_key: bytes | None = None
        # Only blocks lying entirely within the first len-1 tokens may match as full blocks; a
        # block-aligned prompt's last block can then still match partially (bs-1 tokens) below.
        for i in range(limit // bs):
            chunk = token_ids[i * bs : (i + 1) * bs]
            key = block_key_encoded(parent_key, chunk, ns)
            b = index.lookup(key)
            if b is None or not index.confirm(b, parent, chunk, ns):
                break
            matched.append(b)
            parent, parent_key = b, key
        start = len(matched) * bs
        rest = token_ids[start : min(start + bs - 1, limit)]
        best: int | None = None
        best_len = 0
        if rest:
            for child in index.children_starting_with(parent, ns, rest[0]):
                n = _common_prefix_len(index.tokens_of(child), rest)
                if n > best_len or (n == best_len and best is not None and child < best):
                    best, best_len = child, n
        return PrefixHit(tuple(matched), best, best_len, bs)

    def block_keys(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> list[BlockKey]:
        """Keys of the FULL blocks of ``token_ids`` as this manager would cache them (same
        namespace as match_prefix/commit). Empty when caching is disabled."""
        if not self.enable_caching:
            return []
        ns, bs = self._ns(cache_salt), self.block_size
        keys: list[BlockKey] = []
        parent_key: bytes | None = None
        for i in range(len(token_ids) // bs):
            parent_key = block_key_encoded(parent_key, token_ids[i * bs : (i + 1) * bs], ns)
            keys.append(parent_key)
        return keys

    # ---- allocation --------------------------------------------------------------------------
    def num_blocks_needed(
        self, seq_id: Hashable | None, num_tokens: int, *, hit: PrefixHit | None = None
    ) -> int:
        """Blocks that ``allocate(seq_id, num_tokens, hit=hit)`` takes out of free + evictable.

        For a new sequence (``seq_id`` None or unknown) this includes evictable hit blocks that
        admission revives, so ``can_allocate(num_blocks_needed(...))`` is exact.
        """
        target = self._blocks_for(num_tokens)
        st = self._seqs.get(seq_id) if seq_id is not None else None
        if st is not None:
            return max(0, target - len(st.table))
        hit = hit or PrefixHit.empty(self.block_size)
        n_hit = len(hit.block_ids)
        total = max(target, n_hit + (hit.partial_src is not None))
        return total - n_hit + self._hit_revivals(hit)

    def can_allocate(self, n_blocks: int) -> bool:
        """True iff ``n_blocks`` can be obtained from free plus evictable blocks."""
        return n_blocks <= self._pool.num_available

    def allocate(
        self,
        seq_id: Hashable,
        num_tokens: int,
        *,
        hit: PrefixHit | None = None,
        cache_salt: str | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> Allocation | None:
        """Make ``seq_id``'s block table cover ``num_tokens`` tokens.

        First call (admission): shares ``hit.block_ids`` (reviving evictable ones); with a
        partial hit allocates a private block and returns the copy ``(partial_src, dst)``; the
        copy source stays protected from eviction until ``release_copy_sources()``.  Records
        stats: queries += len(token_ids) (or num_tokens when token_ids is None), hits +=
        hit.num_cached_tokens.  ``cache_salt`` and ``token_ids`` are only used at admission;
        passing ``token_ids`` also lets the manager confirm the hit token by token.
        Later calls grow the table.  Returns None and changes nothing when there are not
        enough free + evictable blocks.
        """
        if num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        pool = self._pool
        st = self._seqs.get(seq_id)
        if st is not None:
            if hit is not None:
                raise ValueError(f"sequence {seq_id!r} is already admitted; a hit is only valid at admission")
            need = self._blocks_for(num_tokens) - len(st.table)
            if need <= 0:
                return Allocation()
            if need > pool.num_available:
                return None
            st.table.extend(pool.allocate() for _ in range(need))
            return Allocation()

        hit = hit or PrefixHit.empty(self.block_size)
        ns = self._ns(cache_salt)
        self._validate_hit(hit, ns, token_ids)
        if num_tokens < hit.num_cached_tokens:
            raise ValueError("num_tokens must cover at least the cached tokens of the hit")
        n_hit = len(hit.block_ids)
        total = max(self._blocks_for(num_tokens), n_hit + (hit.partial_src is not None))
        need = total - n_hit
        if need + self._hit_revivals(hit) > pool.num_available:
            return None

        # References on the hit first, so allocating the new blocks cannot evict them.
        for b in hit.block_ids:
            pool.incref(b)
        table = list(hit.block_ids)
        copies: tuple[tuple[int, int], ...] = ()
        if hit.partial_src is not None:
            self._protect_chain(hit.partial_src)
            dst = pool.allocate()
            table.append(dst)
            copies = ((hit.partial_src, dst),)
        table.extend(pool.allocate() for _ in range(total - len(table)))
        self._seqs[seq_id] = _SeqState(table, ns, num_committed=n_hit)
        self._queries += len(token_ids) if token_ids is not None else num_tokens
        self._hits += hit.num_cached_tokens
        return Allocation(copies)

    def release_copy_sources(self) -> None:
        """Drop the protections of copy sources; call after the runner performed the copies."""
        protected, self._protected = self._protected, []
        self._protect_counts.clear()
        for b in protected:
            self._pool.decref(b)

    # ---- caching -----------------------------------------------------------------------------
    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The first ``num_computed_tokens`` of ``token_ids`` now have KV in the seq's blocks.

        Caches every newly full computed block so that other sequences (even ones admitted
        later in the same step) can share it.  A block already cached under another id (same
        key, same tokens) is not cached twice: the sequence keeps its own copy and anchors the
        cached twin (see module docstring).  No-op when caching is disabled.
        """
        st = self._seqs[seq_id]
        bs = self.block_size
        if num_computed_tokens > len(token_ids) or num_computed_tokens > len(st.table) * bs:
            raise ValueError("num_computed_tokens exceeds the tokens or the block table of the sequence")
        if not self.enable_caching or st.chain_broken:
            return
        pool = self._pool
        index = pool.index
        for i in range(st.num_committed, num_computed_tokens // bs):
            parent = st.canonical(i - 1) if i else None
            parent_key = index.key_of(parent) if parent is not None else None
            chunk = token_ids[i * bs : (i + 1) * bs]
            key = block_key_encoded(parent_key, chunk, st.ns)
            b = st.table[i]
            existing = index.lookup(key)
            if existing is None:
                if b in index:
                    raise ValueError(f"block {b} is already cached with other tokens; token_ids changed?")
                pool.register(b, key, parent, chunk, st.ns)
                for listener in self._listeners:
                    listener.block_cached(b, key, parent_key, tuple(chunk), st.ns)
            elif not index.confirm(existing, parent, chunk, st.ns):
                # A real hash collision: never share it, never overwrite it; stop caching this seq.
                st.chain_broken = True
                return
            elif existing != b:
                if b in index:
                    raise ValueError(f"block {b} is already cached with other tokens; token_ids changed?")
                pool.incref(existing)
                st.anchors[i] = existing
            # existing == b: already cached through a fork sibling sharing this very block.
            st.num_committed = i + 1

    # ---- sequence lifecycle ------------------------------------------------------------------
    def free(self, seq_id: Hashable) -> None:
        """Drop all of the seq's references, tail blocks first so tails are evicted before heads."""
        st = self._seqs.pop(seq_id)
        pool = self._pool
        for pos in range(len(st.table) - 1, -1, -1):
            pool.decref(st.table[pos])
            anchor = st.anchors.get(pos)
            if anchor is not None:
                pool.decref(anchor)

    def trim(self, seq_id: Hashable, num_tokens: int) -> int:
        """Release the seq's blocks past those covering ``num_tokens`` (speculative decoding: blocks that
        held only rejected drafts). They were never committed: nothing cached is dropped. Returns how many."""
        st = self._seqs[seq_id]
        keep = self._blocks_for(num_tokens)
        if keep < st.num_committed:
            raise ValueError("trim would drop committed blocks")
        released = 0
        while len(st.table) > keep:
            pos = len(st.table) - 1
            self._pool.decref(st.table.pop())
            anchor = st.anchors.pop(pos, None)
            if anchor is not None:
                self._pool.decref(anchor)
            released += 1
        return released

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares the parent's whole block table (n>1 sampling, beams)."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        st = self._seqs[parent_id]
        for b in st.table:
            self._pool.incref(b)
        for b in st.anchors.values():
            self._pool.incref(b)
        self._seqs[child_id] = _SeqState(
            list(st.table), st.ns, st.num_committed, dict(st.anchors), st.chain_broken
        )

    def prepare_write(self, seq_id: Hashable, position: int) -> tuple[int, int] | None:
        """Copy-on-write before the seq writes KV at ``position``.

        If the block holding ``position`` is shared with another sequence, the seq gets a fresh
        block in its place and ``(src, dst)`` is returned for the runner to copy; ``src`` stays
        protected until ``release_copy_sources()``.  Otherwise returns None.  A block referenced
        only by pending copy protections counts as unshared: copies run before the forward, so
        writing it in place is safe.  Raises NoFreeBlocksError when no block is available.
        """
        st = self._seqs[seq_id]
        pos = position // self.block_size
        if position < 0 or pos >= len(st.table):
            raise IndexError(f"position {position} lies outside the block table; allocate first")
        src = st.table[pos]
        if src in self._pool.index:
            raise ValueError(f"block {src} is cached and immutable; writing at {position} would corrupt it")
        if self._pool.ref_count(src) - self._protect_counts[src] <= 1:
            return None
        if self._pool.num_available < 1:
            raise NoFreeBlocksError("no block available for copy-on-write")
        dst = self._pool.allocate()
        st.table[pos] = dst
        # The seq's table reference on src becomes the copy protection (net ref unchanged).
        self._protected.append(src)
        self._protect_counts[src] += 1
        return (src, dst)

    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to ``num_blocks`` evictable blocks onto the free list (LRU leaves first)."""
        return self._pool.evict(num_blocks)

    # ---- retention (block_pool.py: an eviction order, never a pin) -------------------------------
    def retain_prefix(self, seq_id: Hashable, num_tokens: int, ttl_s: float, *, from_token: int = 0
                      ) -> tuple[list[int], int]:
        """Retain the cached chain of the seq's first ``num_tokens`` tokens (its full committed blocks within
        them) for ``ttl_s`` seconds from now. Returns (the chain's block ids, how many of those from the one
        holding token ``from_token`` on were not retained before)."""
        st = self._seqs[seq_id]
        pool = self._pool
        until = pool.clock() + ttl_s
        chain, new = [], 0
        for pos in range(min(st.num_committed, num_tokens // self.block_size)):
            b = st.canonical(pos)
            new += (pos + 1) * self.block_size > from_token and not pool.is_retained(b)
            pool.retain(b, until)
            chain.append(b)
        return chain, new

    def retain_tokens(self, token_ids: Sequence[int], ttl_s: float, *, cache_salt: str | None = None
                      ) -> tuple[list[int], int]:
        """Retain the cached full blocks of ``token_ids``' prefix (as far as it is cached) for ``ttl_s`` seconds:
        the operator's warm-up. Returns (their block ids, how many were not retained before)."""
        pool = self._pool
        until = pool.clock() + ttl_s
        chain, new = [], 0
        for b in self.cached_chain(token_ids, cache_salt=cache_salt):
            new += not pool.is_retained(b)
            pool.retain(b, until)
            chain.append(b)
        return chain, new

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """End the retention of these blocks (those still cached and retained)."""
        for b in block_ids:
            self._pool.release(b)

    def release_tokens(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """End the retention of ``token_ids``' cached prefix; returns how many blocks were retained."""
        chain = [b for b in self.cached_chain(token_ids, cache_salt=cache_salt) if self._pool.is_retained(b)]
        self.release_blocks(chain)
        return len(chain)

    def cached_chain(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> list[int]:
        """The cached blocks of ``token_ids``' full blocks, from the root, as far as they are cached."""
        index, ns, bs = self._pool.index, self._ns(cache_salt), self.block_size
        chain: list[int] = []
        parent_key = None
        for i in range(len(token_ids) // bs):
            chunk = token_ids[i * bs : (i + 1) * bs]
            key = block_key_encoded(parent_key, chunk, ns)
            b = index.lookup(key)
            if b is None or not index.confirm(b, chain[-1] if chain else None, chunk, ns):
                break
            chain.append(b)
            parent_key = key
        return chain

    def is_retained(self, block_id: int) -> bool:
        return self._pool.is_retained(block_id)

    def cached_block(self, key: BlockKey) -> tuple[int, BlockKey | None, tuple[int, ...], bytes] | None:
        """The block cached under ``key`` now: (block id, parent key, token ids, namespace), or None."""
        index = self._pool.index
        b = index.lookup(key)
        if b is None:
            return None
        parent = index.parent_of(b)
        return b, None if parent is None else index.key_of(parent), index.tokens_of(b), index.ns_of(b)

    def key_of(self, block_id: int) -> BlockKey | None:
        """The key a block is cached under (None: not cached): whether an id still holds what it held."""
        index = self._pool.index
        return index.key_of(block_id) if block_id in index else None

    # ---- introspection -----------------------------------------------------------------------
    def block_ids(self, seq_id: Hashable) -> list[int]:
        return list(self._seqs[seq_id].table)

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def num_free_blocks(self) -> int:
        """Free plus evictable blocks (what admission may use)."""
        return self._pool.num_available

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref_count(block_id)

    def is_cached(self, block_id: int) -> bool:
        return self._pool.is_cached(block_id)

    def free_list(self) -> list[int]:
        """The free list in allocation order (for tests and debugging)."""
        return self._pool.free_list()

    def usage(self) -> dict[str, int]:
        pool = self._pool
        return {
            "num_blocks": pool.num_blocks,
            "num_free": pool.num_free,
            "num_evictable": pool.num_evictable,
            "num_in_use": pool.num_in_use,
            "peak_in_use": pool.peak_in_use,
            "num_retained": pool.num_retained,
            "num_retention_expired": pool.num_retention_expired,
            "num_retained_evicted": pool.num_retained_evicted,
        }

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits, self._pool.num_evictions)

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant is violated.  O(num_blocks): tests and debugging."""
        pool = self._pool
        pool.check_integrity()
        index = pool.index
        expected = [0] * pool.num_blocks
        for seq_id, st in self._seqs.items():
            for b in st.table:
                expected[b] += 1
            for pos, b in st.anchors.items():
                expected[b] += 1
                if pos >= st.num_committed or st.table[pos] in index:
                    raise AssertionError(f"seq {seq_id!r}: bad anchor at position {pos}")
            if st.num_committed > len(st.table):
                raise AssertionError(f"seq {seq_id!r}: committed past its table")
            parent: int | None = None
            for pos in range(st.num_committed):
                b = st.canonical(pos)
                if b not in index or index.parent_of(b) != parent or index.ns_of(b) != st.ns:
                    raise AssertionError(f"seq {seq_id!r}: committed block {pos} is not a cached chain link")
                parent = b
        for b in self._protected:
            expected[b] += 1
        if Counter(self._protected) != +self._protect_counts:
            raise AssertionError("protection counts disagree with the protection list")
        for b in range(pool.num_blocks):
            if pool.ref_count(b) != expected[b]:
                raise AssertionError(
                    f"block {b}: ref_count {pool.ref_count(b)} != table uses + protections + anchors {expected[b]}"
                )
