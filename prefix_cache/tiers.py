"""The slower KV tiers below the device pool: host memory, then a remote store (Redis).

    device pool --evicted full block--> host slots (LRU, bytes-bounded)
        |   ^                                |
        |   +------ load (host hit) ---------+
        |   +------ load (remote hit) -------------------- remote store (shared by replicas)
        +---------- newly cached full block (write-through) --------^

* Demotion.  A full block evicted from the device is copied into a host slot (``block_evicted``).
* Write-through.  With a remote store, every newly cached full block is written to it
  (``block_cached`` -> ``take_writes`` -> the engine reads the bytes -> ``submit_writes``), so a
  prefix one replica computed is a hit for every other replica at once -- waiting for device
  and host eviction would keep it private for as long as it stays popular.  Blocks that were
  themselves loaded from a tier are not written again.
* Long retention.  ``persist`` (a retention longer than the device and host tiers are trusted
  with, engine/retention.py) asks the remote store to keep the retained blocks' entries at least
  that long: present entries get their expiry extended, never rewritten; the ones it reports
  absent (a dropped write, an entry expired or evicted there) are written from the device pool
  by the next ``take_writes``, with that expiry, if they are still cached there.
* Promotion.  ``extend`` continues a device prefix hit with host hits, then remote hits
  (pipelined existence checks and fetches that stop at the first miss), each confirmed by its
  parent key, tokens and namespace -- never by key alone -- and only when the cost model says
  loading beats recomputing.  Loaded blocks become ordinary private blocks of the admitted
  sequence and are cached by its next ``commit``, exactly like computed ones: nothing half-loaded
  is ever visible to other sequences, and a failed step leaves nothing behind.
* Swap.  ``swap_out`` copies a preempted sequence's blocks into pinned host slots;
  ``swap_in`` brings them back into fresh device blocks, so it resumes without recomputation.

Decisions here, bytes elsewhere.  Everything above produces plain data -- ``KVTransfers`` --
that the scheduler hands the model runner with the step; the runner performs it before the
step's block copies and forward, in this order: device->host, host->device, remote->device.
That order is what makes same-step reuse safe: a block evicted (and demoted) this step may be
reallocated as a load destination or copy target this step; a host slot read by a load this
step is pinned until ``end_step`` so it cannot be reused under it.

Step protocol (the engine drives it): ``begin_step`` -> scheduling calls (``extend`` /
``commit_load``, ``swap_out``, ``swap_in``, eviction callbacks) -> ``take_transfers`` ->
runner -> ``end_step(ok)`` -> commit -> ``take_writes`` / ``submit_writes``.  ``end_step(False)``
(the step failed, the transfers may not have run) forgets every host slot written this step and
every swap made this step.

Torch-free and Redis-free: the remote store is any object with the ``RemoteKVStore`` interface
(``prefix_cache.redis_store.RedisKVStore`` in production).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .hashing import BlockKey
from .host_pool import HostKVPool
from .kv_codec import BlockMeta, DecodedBlock, KVLayout, digest
from .manager import BlockManager, PrefixHit

HOST = "host"
REMOTE = "remote"
LOAD_POLICIES = ("auto", "always")


@dataclass(frozen=True)
class KVTransfers:
    """KV moves the model runner performs before a step's block copies and forward, in field order.

    ``device_to_host``: (device block, host slot) -- demotions and swap-outs;
    ``host_to_device``: (host slot, device block) -- host hits and swap-ins;
    ``remote_to_device``: (device block, raw KV bytes of one block as fetched from the remote store).
    """

    device_to_host: tuple[tuple[int, int], ...] = ()
    host_to_device: tuple[tuple[int, int], ...] = ()
    remote_to_device: tuple[tuple[int, memoryview], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.device_to_host or self.host_to_device or self.remote_to_device)


@dataclass(frozen=True)
class TransferTimings:
    """What the runner measured while performing one KVTransfers (seconds, blocks)."""

    device_to_host_s: float = 0.0
    num_device_to_host: int = 0
    host_to_device_s: float = 0.0
    num_host_to_device: int = 0
    remote_to_device_s: float = 0.0
    num_remote_to_device: int = 0


class RemoteKVStore(Protocol):
    """A shared store of KV blocks keyed by block key (Redis in production).

    Every call returns quickly and never raises for store failures: reads degrade to fewer hits,
    writes to dropped writes (both counted in ``stats``).
    """

    layout: KVLayout

    def fetch_prefix(self, keys: Sequence[BlockKey]) -> list[DecodedBlock]:
        """Decoded, verified blocks for the longest leading run of ``keys`` the store holds."""
        ...

    def put(self, meta: BlockMeta, payload: bytes | memoryview, *, ttl_s: float | None = None) -> bool:
        """Queue a write without blocking; False when it was dropped. ``ttl_s``: the entry must live at
        least that long (a long retention's block); None: the store's own expiry."""
        ...

    def retain(self, keys: Sequence[BlockKey], ttl_s: float) -> bool:
        """Queue a long retention without blocking: present entries live at least ``ttl_s`` more seconds,
        absent ones are reported by ``take_missing``."""
        ...

    def take_missing(self) -> list[tuple[BlockKey, float]]:
        """(key, ttl_s) of retained blocks found absent since the last call."""
        ...

    def count_prefix(self, keys: Sequence[BlockKey]) -> int | None:
        """How many of ``keys``, from the first, the store holds; None when it did not answer."""
        ...

    @property
    def has_missing(self) -> bool:
        """``take_missing`` would return something."""
        ...

    def flush(self, timeout: float) -> bool: ...

    def close(self, timeout: float = 5.0) -> None: ...

    def stats(self) -> dict[str, int]: ...


class LoadCostModel:
    """Load or recompute?  Running estimates, not constants.

    Keeps exponential moving averages of the time to recompute one token (from prefill-heavy
    steps) and of the time to load one block from each tier (fetch plus copy), and says a tier is
    worth loading from when ``load_per_block < block_size * recompute_per_token``.  Until both
    sides have been measured it loads (that is how they get measured).  When recompute wins it
    still loads on every ``probe_every``-th decision, so an estimate spoiled by one bad moment (a
    Redis hiccup) recovers.  ``mode="always"`` loads whenever a tier has the block.
    """

    def __init__(self, block_size: int, mode: str = "auto", *, alpha: float = 0.2, probe_every: int = 16) -> None:
        if mode not in LOAD_POLICIES:
            raise ValueError(f"mode must be one of {LOAD_POLICIES}, got {mode!r}")
        if block_size < 1 or not 0.0 < alpha <= 1.0 or probe_every < 1:
            raise ValueError("block_size >= 1, 0 < alpha <= 1 and probe_every >= 1 are required")
        self.block_size, self.mode, self.alpha, self.probe_every = block_size, mode, alpha, probe_every
        self.recompute_per_token: float | None = None
        self.load_per_block: dict[str, float | None] = {HOST: None, REMOTE: None}
        self._declined: Counter[str] = Counter()

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def record_prefill(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds >= 0:
            self.recompute_per_token = self._ema(self.recompute_per_token, seconds / tokens)

    def record_load(self, tier: str, seconds: float, blocks: int) -> None:
        if blocks > 0 and seconds >= 0:
            self.load_per_block[tier] = self._ema(self.load_per_block[tier], seconds / blocks)

    def prefers_load(self, tier: str) -> bool:
        """The estimates' verdict alone (no probing)."""
        load, per_token = self.load_per_block[tier], self.recompute_per_token
        if self.mode == "always" or load is None or per_token is None:
            return True
        return load < self.block_size * per_token

    def worth_loading(self, tier: str) -> bool:
        """The decision for one lookup (counts declines to probe now and then)."""
        if self.prefers_load(tier):
            return True
        self._declined[tier] += 1
        return self._declined[tier] % self.probe_every == 0

    def snapshot(self) -> dict[str, float | None]:
        return {
            "recompute_per_token_s": self.recompute_per_token,
            "host_load_per_block_s": self.load_per_block[HOST],
            "remote_load_per_block_s": self.load_per_block[REMOTE],
        }


@dataclass(frozen=True)
class TierLoad:
    """What ``extend`` found: the device part of the hit (full blocks only) continued by host
    slots, then remote blocks, for the prompt blocks right after it, in order."""

    hit: PrefixHit
    host_slots: tuple[int, ...]
    remote_payloads: tuple[memoryview, ...]
    keys: tuple[BlockKey, ...]
    fetch_seconds: float = 0.0

    @property
    def num_blocks(self) -> int:
        return len(self.host_slots) + len(self.remote_payloads)

    @property
    def num_cached_tokens(self) -> int:
        """Device-hit tokens plus loaded tokens: where the sequence's computation starts."""
        return self.hit.num_cached_tokens + self.num_blocks * self.hit.block_size


@dataclass(frozen=True)
class PendingWrite:
    block_id: int
    meta: BlockMeta
    ttl_s: float | None = None  # a long retention's block: its entry lives at least this long


@dataclass
class _Swap:
    num_computed_tokens: int
    slots: list[int]  # slot of the sequence's block at each table position


@dataclass
class _Counters:
    host_hits: int = 0  # blocks loaded from host slots
    host_stores: int = 0  # evicted device blocks copied into host slots
    host_full: int = 0  # evicted device blocks dropped: every host slot pinned or swap
    remote_hits: int = 0  # blocks loaded from the remote store
    remote_rejected: int = 0  # remote blocks whose parent, tokens or namespace did not match
    loaded_tokens: int = 0
    recompute_decisions: int = 0  # lookups where the cost model chose recomputing
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_failures: int = 0  # preemptions that fell back to recompute: no host room
    remote_retained_lost: int = 0  # long-retained blocks absent from the remote store and gone from the device


class KVTiers:
    """Host and remote tiers for one BlockManager (see module docstring).

    Invariants (checked by ``check_integrity``): the host pool's own; every swap slot belongs to
    exactly one swapped-out sequence or is released at the end of this step; every host pin was
    taken this step and is released by ``end_step``.
    """

    def __init__(
        self,
        blocks: BlockManager,
        *,
        host: HostKVPool | None = None,
        remote: RemoteKVStore | None = None,
        costs: LoadCostModel | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.blocks = blocks
        self.host = host
        self.remote = remote
        self.costs = costs or LoadCostModel(blocks.block_size)
        self._clock = clock
        self.counters = _Counters()
        self._swapped: dict[Hashable, _Swap] = {}
        # -- this step's state (reset by end_step) --
        self._d2h: list[tuple[int, int]] = []
        self._h2d: list[tuple[int, int]] = []
        self._r2d: list[tuple[int, memoryview]] = []
        self._pins: list[int] = []  # host slots pinned as load sources
        self._saved: list[tuple[int, BlockKey]] = []  # host slots written by demotions
        self._new_swaps: list[Hashable] = []
        self._release: list[int] = []  # swap slots read by swap-ins, freed once they ran
        self._remote_fetch_s = 0.0
        self._remote_loaded = 0
        self._handed_out = False  # take_transfers ran and end_step has not yet
        # keys of blocks loaded from a tier: their commit must not write them back (until the next step)
        self._loaded_keys: set[BlockKey] = set()
        self._writes: list[PendingWrite] = []
        self._persisting = False  # a long retention was asked of the remote store (its absent blocks to write)
        # Told of each block handed to the remote store's writer (KV events report it as STORAGE).
        self.on_remote_write: Callable[[BlockMeta], None] | None = None
        if self.enabled:  # with neither tier (the null object) block events cost nothing
            blocks.add_listener(self)

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.remote is not None

    # ---- BlockListener ------------------------------------------------------------------
    def block_cached(
        self, block_id: int, key: BlockKey, parent_key: BlockKey | None, token_ids: tuple[int, ...], ns: bytes
    ) -> None:
        if self.remote is None or key in self._loaded_keys:
            return
        self._writes.append(PendingWrite(block_id, BlockMeta(key, parent_key, token_ids, digest(ns))))

    def block_evicted(
        self, block_id: int, key: BlockKey, parent_key: BlockKey | None, token_ids: tuple[int, ...], ns: bytes
    ) -> None:
        if self.host is None:
            return
        placed = self.host.insert(key, parent_key, token_ids, ns)
        if placed is None:
            self.counters.host_full += 1
            return
        slot, is_new = placed
        if is_new:
            self._d2h.append((block_id, slot))
            self._saved.append((slot, key))
            self.counters.host_stores += 1

    # ---- promotion ------------------------------------------------------------------------
    def extend(self, token_ids: Sequence[int], cache_salt: str | None, hit: PrefixHit) -> TierLoad | None:
        """Continue the device hit's full blocks with host, then remote, blocks (None: nothing to
        load, or recomputing is cheaper).  Like ``match_prefix`` it never covers the last prompt
        token.  Pins the host slots it returns until ``end_step``; changes nothing else."""
        blocks = self.blocks
        bs = blocks.block_size
        limit = max(len(token_ids) - 1, 0) // bs
        n_dev = len(hit.block_ids)
        if not blocks.enable_caching or not self.enabled or n_dev >= limit:
            return None
        keys = blocks.block_keys(token_ids[: limit * bs], cache_salt=cache_salt)
        ns = blocks.namespace(cache_salt)
        parent_key = keys[n_dev - 1] if n_dev else None
        i = n_dev
        host = self.host
        slots: list[int] = []
        if host is not None and host.lookup(keys[i]) is not None:
            if not self.costs.worth_loading(HOST):
                self.counters.recompute_decisions += 1
                return None
            while i < limit:
                slot = host.lookup(keys[i])
                if slot is None or not host.confirm(slot, parent_key, token_ids[i * bs:(i + 1) * bs], ns):
                    break
                host.pin(slot)
                self._pins.append(slot)
                slots.append(slot)
                parent_key = keys[i]
                i += 1
        payloads: list[memoryview] = []
        fetch_seconds = 0.0
        if self.remote is not None and i < limit:
            if not self.costs.worth_loading(REMOTE):
                self.counters.recompute_decisions += 1
            else:
                start = self._clock()
                found = self.remote.fetch_prefix(keys[i:limit])
                fetch_seconds = self._clock() - start
                ns_digest = digest(ns)
                for block in found:
                    m = block.meta
                    if (m.parent_key != parent_key or m.ns_digest != ns_digest
                            or m.token_ids != tuple(token_ids[i * bs:(i + 1) * bs])):
                        self.counters.remote_rejected += 1
                        break
                    payloads.append(block.payload)
                    parent_key = keys[i]
                    i += 1
        if i == n_dev:
            return None
        device_hit = PrefixHit(hit.block_ids, None, 0, bs)
        return TierLoad(device_hit, tuple(slots), tuple(payloads), tuple(keys[n_dev:i]), fetch_seconds)

    def commit_load(self, load: TierLoad, dst_blocks: Sequence[int]) -> None:
        """The sequence was admitted with ``load``: fill ``dst_blocks`` (its table right after the
        device hit) from the tiers before this step's forward."""
        if len(dst_blocks) != load.num_blocks:
            raise ValueError(f"{len(dst_blocks)} destination blocks for {load.num_blocks} loaded blocks")
        n_host = len(load.host_slots)
        self._h2d.extend(zip(load.host_slots, dst_blocks[:n_host]))
        self._r2d.extend(zip(dst_blocks[n_host:], load.remote_payloads))
        self._loaded_keys.update(load.keys)
        c = self.counters
        c.host_hits += n_host
        c.remote_hits += len(load.remote_payloads)
        c.loaded_tokens += load.num_blocks * self.blocks.block_size
        if load.remote_payloads:
            self._remote_fetch_s += load.fetch_seconds
            self._remote_loaded += len(load.remote_payloads)

    # ---- swap -----------------------------------------------------------------------------
    def swap_out(self, seq_id: Hashable, block_ids: Sequence[int], num_computed_tokens: int) -> bool:
        """Copy a preempted sequence's blocks (its table up to num_computed_tokens) into host swap
        slots.  False -- nothing changed -- when there is no host tier or not enough room."""
        if self.host is None or seq_id in self._swapped:
            return False
        slots = self.host.take_swap_slots(len(block_ids))
        if slots is None:
            self.counters.swap_failures += 1
            return False
        self._d2h.extend(zip(block_ids, slots))
        self._swapped[seq_id] = _Swap(num_computed_tokens, slots)
        self._new_swaps.append(seq_id)
        self.counters.swapped_out_blocks += len(slots)
        return True

    def swapped_tokens(self, seq_id: Hashable) -> int | None:
        """num_computed_tokens saved by ``swap_out`` for this sequence, or None."""
        rec = self._swapped.get(seq_id)
        return None if rec is None else rec.num_computed_tokens

    def swap_in(self, seq_id: Hashable, table: Sequence[int], first_pos: int) -> None:
        """The resumed sequence got ``table``; positions before ``first_pos`` are device cache hits,
        the rest of its swapped blocks are copied back.  Its swap slots are freed at end_step."""
        rec = self._swapped.pop(seq_id)
        n = len(rec.slots)
        if len(table) < n or not 0 <= first_pos <= n:
            raise ValueError("the table must cover the swapped blocks and first_pos lie within them")
        self._h2d.extend((rec.slots[pos], table[pos]) for pos in range(first_pos, n))
        self._release.extend(rec.slots)
        self.counters.swapped_in_blocks += n - first_pos

    def drop_swap(self, seq_id: Hashable) -> None:
        """Forget a swapped-out sequence (finished or aborted while waiting); call between steps."""
        rec = self._swapped.pop(seq_id, None)
        if rec is not None and self.host is not None:
            for slot in rec.slots:
                self.host.release_swap_slot(slot)

    # ---- step protocol ----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start scheduling a step.  Demotions of blocks evicted between steps (an explicit
        ``BlockManager.evict``) stay pending and go with this step's transfers."""
        if self._handed_out:  # the previous step's transfers were taken but it never ended
            self.end_step(False)
        self._loaded_keys.clear()

    def take_transfers(self) -> KVTransfers:
        transfers = KVTransfers(tuple(self._d2h), tuple(self._h2d), tuple(self._r2d))
        self._d2h, self._h2d, self._r2d = [], [], []
        self._handed_out = True
        return transfers

    def end_step(self, ok: bool) -> None:
        """Release this step's pins and consumed swap slots.  ``ok=False``: the transfers may not
        have run, so forget what they were meant to write (host slots, swaps)."""
        host = self.host
        if host is not None:
            for slot in self._pins:
                host.unpin(slot)
            for slot in self._release:
                host.release_swap_slot(slot)
            if not ok:
                for slot, key in self._saved:
                    if host.lookup(key) == slot and host.pins(slot) == 0:
                        host.discard(slot)
                for seq_id in self._new_swaps:
                    self.drop_swap(seq_id)
        self._d2h, self._h2d, self._r2d = [], [], []
        self._pins, self._saved, self._new_swaps, self._release = [], [], [], []
        self._remote_fetch_s, self._remote_loaded = 0.0, 0
        self._handed_out = False

    def record_step(self, seconds: float, tokens: int, timings: TransferTimings | None) -> None:
        """Feed the cost model: a step's forward time (transfers excluded) and its transfer times."""
        if timings is not None:
            self.costs.record_load(HOST, timings.host_to_device_s, timings.num_host_to_device)
            if self._remote_loaded and timings.num_remote_to_device:
                self.costs.record_load(
                    REMOTE, self._remote_fetch_s + timings.remote_to_device_s, timings.num_remote_to_device
                )
        if tokens >= self.blocks.block_size:  # prefill-heavy steps say what recomputing costs
            self.costs.record_prefill(seconds, tokens)

    # ---- write-through ------------------------------------------------------------------------
    def take_writes(self) -> list[PendingWrite]:
        """Blocks cached since the last call that the remote store should get, and long-retained
        blocks it reported absent; the caller reads their bytes now (they are immutable while
        cached) and passes them to ``submit_writes``.  Call between steps."""
        writes, self._writes = self._writes, []
        if self.remote is not None and self._persisting:
            writes += self.take_retained_writes()
        return writes

    def submit_writes(self, writes: Sequence[PendingWrite], payloads: Sequence[bytes | memoryview]) -> None:
        if self.remote is None:
            return
        for w, payload in zip(writes, payloads, strict=True):
            if w.ttl_s is None:
                self.remote.put(w.meta, payload)
            else:
                self.remote.put(w.meta, payload, ttl_s=w.ttl_s)
            if self.on_remote_write is not None:
                self.on_remote_write(w.meta)

    # ---- long retention ---------------------------------------------------------------------------
    def persist(self, retained: dict[int, float]) -> None:
        """Keep these cached blocks (block id -> retention seconds from now) in the remote store at least
        that long: one queued retention per TTL, never blocking; the blocks the store lacks are written by
        a later ``take_writes``.  Nothing without a remote store."""
        if self.remote is None or not retained:
            return
        by_ttl: dict[float, list[BlockKey]] = {}
        for b, ttl_s in retained.items():
            key = self.blocks.key_of(b)
            if key is not None:
                by_ttl.setdefault(ttl_s, []).append(key)
        for ttl_s, keys in by_ttl.items():
            self.remote.retain(keys, ttl_s)
        self._persisting = True

    def take_retained_writes(self) -> list[PendingWrite]:
        """The long-retained blocks the remote store reported absent, still cached on the device, to write with
        their retention's expiry (part of ``take_writes``; alone between steps)."""
        if self.remote is None:
            return []
        wanted: dict[BlockKey, float] = {}
        for key, ttl_s in self.remote.take_missing():
            wanted[key] = max(ttl_s, wanted.get(key, 0.0))
        writes: list[PendingWrite] = []
        for key, ttl_s in wanted.items():
            found = self.blocks.cached_block(key)
            if found is None:  # evicted from the device since it was retained: nothing to write it from
                self.counters.remote_retained_lost += 1
                continue
            block_id, parent_key, token_ids, ns = found
            writes.append(PendingWrite(block_id, BlockMeta(key, parent_key, token_ids, digest(ns)), ttl_s))
        return writes

    @property
    def has_pending_retained(self) -> bool:
        """The remote store reported long-retained blocks absent: a ``take_writes`` would write them."""
        return self.remote is not None and self._persisting and self.remote.has_missing

    def count_remote(self, keys: Sequence[BlockKey]) -> int | None:
        """Blocks of ``keys``, from the first, present in the remote store (one round trip); None when there
        is no remote store or it did not answer.  Thread-safe (it reads no engine state)."""
        if self.remote is None:
            return None
        return self.remote.count_prefix(keys)

    # ---- introspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        c = self.counters
        out: dict[str, int | float] = {
            "host_hits": c.host_hits, "host_stores": c.host_stores, "host_full": c.host_full,
            "remote_hits": c.remote_hits, "remote_rejected": c.remote_rejected,
            "loaded_tokens": c.loaded_tokens, "recompute_decisions": c.recompute_decisions,
            "swapped_out_blocks": c.swapped_out_blocks, "swapped_in_blocks": c.swapped_in_blocks,
            "swap_failures": c.swap_failures, "remote_retained_lost": c.remote_retained_lost,
        }
        if self.host is not None:
            out.update(host_evictions=self.host.num_evictions, host_slots=self.host.num_slots,
                       host_slots_used=self.host.num_cached + self.host.num_swap)
        if self.remote is not None:
            out.update({f"remote_{k}": v for k, v in self.remote.stats().items()})
        return out

    def check_integrity(self) -> None:
        host = self.host
        if host is None:
            if self._swapped or self._pins:
                raise AssertionError("swaps or pins without a host tier")
            return
        host.check_integrity()
        owned = [s for rec in self._swapped.values() for s in rec.slots] + self._release
        if len(owned) != len(set(owned)) or set(owned) != host.swap_slots():
            raise AssertionError("swap slots and swapped-out sequences disagree")
        for slot, n in Counter(self._pins).items():
            if host.pins(slot) != n:
                raise AssertionError(f"host slot {slot} has {host.pins(slot)} pins, this step took {n}")
        if sum(host.pins(s) for s in host.cached_slots()) != len(self._pins):
            raise AssertionError("host slots pinned outside this step")

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until queued remote writes are written (True) or ``timeout`` passed (False)."""
        return self.remote.flush(timeout) if self.remote is not None else True

    def close(self, timeout: float = 5.0) -> None:
        if self.remote is not None:
            self.remote.close(timeout)
