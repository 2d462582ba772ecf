"""Scheduler: decides, each step, which sequences advance by how many tokens.

Its output is plain data (SchedulerOutput); only the model runner builds tensors. Every kind
of progress — prefill, chunked prefill, prefix-cache hit, decode — is "advance
num_computed_tokens by num_new_tokens" within a token budget.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.inflight_prefixes import InflightPrefixes
from engine.sequence import Sequence, SequenceStatus
from prefix_cache import BlockManager, KVTiers, KVTransfers, NoFreeBlocksError, PrefixHit


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # == seq.num_computed_tokens when scheduled
    num_new_tokens: int
    block_ids: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def needs_sample(self) -> bool:
        """The chunk reaches the last known token, so its last position's logits pick the next one."""
        return self.end == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    copies: tuple[tuple[int, int], ...]  # (src, dst) KV block copies to run before the forward
    preempted: tuple[Sequence, ...]
    # Tier moves (demotions, loads, swaps) to run before the copies; see prefix_cache/tiers.py.
    transfers: KVTransfers = KVTransfers()

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.transfers

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str  # "fcfs" | "priority"


_DEFERRED = object()


class Scheduler:
    """Owns the waiting and running queues; the BlockManager owns every block id.

    Invariants: a sequence is in exactly one of waiting / running / (finished, dropped);
    running sequences hold blocks covering their num_computed_tokens; waiting ones hold none.
    """

    def __init__(
        self, limits: SchedulerLimits, blocks: BlockManager, *, tiers: KVTiers | None = None,
        preemption_mode: str = "recompute",
    ) -> None:
        self.limits = limits
        self.blocks = blocks
        self.tiers = tiers  # host / Redis tiers: loads at admission, swap at preemption
        self.preemption_mode = preemption_mode
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0
        self.inflight = InflightPrefixes(blocks)

    # -- queues -----------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple[int, ...]:
        return seq.sort_key(self.limits.policy)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def adopt(self, seq: Sequence) -> None:
        """A fork that already holds blocks (shared with its parent) joins the running set."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=self._key)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it and release its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.blocks.has_seq(seq.seq_id):
            self.blocks.free(seq.seq_id)
        if self.tiers is not None:
            self.tiers.drop_swap(seq.seq_id)
        self.inflight.forget(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the decision -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        if self.tiers is not None:
            self.tiers.begin_step()
        chunks: list[ScheduledChunk] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []

        # 1. Running sequences first, most important first: decodes and unfinished prefills.
        scheduled: set[str] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:  # a beam waiting for its siblings' candidates
                continue
            grown = self._grow_or_preempt(seq, num_new, scheduled, preempted)
            if grown is None:
                continue
            copies.extend(grown)
            chunks.append(self._chunk(seq, num_new))
            scheduled.add(seq.seq_id)
            budget -= num_new

        # 2. Admit waiting sequences while there is room — but not in a step that had to preempt,
        #    or the newcomer would just take the blocks back and thrash.
        self.inflight.begin_step(self.running)
        for seq in list(self.waiting):
            if budget == 0 or preempted or len(self.running) + seq.group_size > self.limits.max_num_seqs:
                break
            admitted = self._admit(seq, budget)
            if admitted is None:
                break
            if admitted is _DEFERRED:
                continue
            chunk, new_copies = admitted
            self.waiting.remove(seq)
            bisect.insort(self.running, seq, key=self._key)
            seq.status = SequenceStatus.RUNNING
            chunks.append(chunk)
            copies.extend(new_copies)
            budget -= chunk.num_new_tokens

        transfers = self.tiers.take_transfers() if self.tiers is not None else KVTransfers()
        return SchedulerOutput(tuple(chunks), tuple(copies), tuple(preempted), transfers)

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        return ScheduledChunk(seq, seq.num_computed_tokens, num_new, tuple(self.blocks.block_ids(seq.seq_id)))

    def _grow_or_preempt(
        self, seq: Sequence, num_new: int, scheduled: set[str], preempted: list[Sequence]
    ) -> list[tuple[int, int]] | None:
        """Make seq's blocks cover num_computed + num_new tokens — copying a block it shares with
        forks before writing into it — preempting the least important unscheduled running
        sequences (seq itself last) until that fits. Returns the block copies to run first, or
        None if seq itself was preempted."""
        copies: list[tuple[int, int]] = []
        position = seq.num_computed_tokens
        while True:
            try:
                if position % self.blocks.block_size:  # the first write lands in an existing block
                    copy = self.blocks.prepare_write(seq.seq_id, position)
                    if copy is not None:
                        copies.append(copy)
                if self.blocks.allocate(seq.seq_id, position + num_new) is not None:
                    return copies
            except NoFreeBlocksError:
                pass
            victims = [s for s in self.running if s.seq_id not in scheduled and s is not seq]
            victim = victims[-1] if victims else seq
            # seq's own copy-on-write (if any) never runs: its swap must read the copy's source
            self._preempt(victim, pending_copies=copies if victim is seq else ())
            preempted.append(victim)
            if victim is seq:
                return None  # its copy (if any) went with its blocks

    def _preempt(self, seq: Sequence, pending_copies=()) -> None:
        # Recompute mode: release the blocks (full ones stay cached, so resuming is mostly a
        # prefix hit) and restart from token 0 when readmitted. Swap mode: first copy the blocks
        # holding KV to host memory; readmission copies them back (falls back to recompute when
        # the host tier has no room).
        self.running.remove(seq)
        # At least the last token is recomputed on readmission: its logits pick the next token.
        saved = min(seq.num_computed_tokens, seq.num_tokens - 1)
        if self.preemption_mode == "swap" and self.tiers is not None and saved > 0:
            unwritten = {dst: src for src, dst in pending_copies}
            table = self.blocks.block_ids(seq.seq_id)[: -(-saved // self.blocks.block_size)]
            self.tiers.swap_out(seq.seq_id, [unwritten.get(b, b) for b in table], saved)
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _admit(self, seq: Sequence, budget: int):
        """(chunk, copies) if admitted; None if the pool is full; _DEFERRED if an in-flight
        prefill is computing this sequence's next prefix block (admit it as a hit later)."""
        first_admission = seq.num_preemptions == 0
        if self.tiers is not None and self.tiers.swapped_tokens(seq.seq_id) is not None:
            return self._swap_in(seq, budget)
        if seq.params.prompt_logprobs is not None and first_admission:
            # Prompt logprobs need the logits of every prompt position: no prefix reuse.
            hit = PrefixHit.empty(self.blocks.block_size)
        else:
            hit = self.blocks.match_prefix(seq.token_ids, cache_salt=seq.cache_salt)
            if self.inflight.should_defer(seq, hit):
                return _DEFERRED
        alloc, cached = None, hit.num_cached_tokens
        if self.tiers is not None and (seq.params.prompt_logprobs is None or not first_admission):
            alloc, cached = self._admit_with_tier_hits(seq, hit, budget)
        if alloc is None:
            cached = hit.num_cached_tokens
            num_new = min(seq.num_tokens - cached, budget)
            alloc = self.blocks.allocate(
                seq.seq_id, cached + num_new, hit=hit, cache_salt=seq.cache_salt, token_ids=seq.token_ids,
            )
            if alloc is None:
                return None
        seq.num_computed_tokens = cached
        # With the device hit, not `cached`: blocks loaded from a tier count as in flight, so a twin
        # admitted this step waits for this sequence's commit instead of loading them again.
        self.inflight.admitted(seq, hit)
        if first_admission:
            seq.num_cached_tokens = cached
        return self._chunk(seq, min(seq.num_tokens - cached, budget)), alloc.copies

    def _admit_with_tier_hits(self, seq: Sequence, hit: PrefixHit, budget: int):
        """(allocation, cached tokens) when the host / Redis tiers continue the device hit and the
        sequence fits with them; (None, 0) otherwise (then admit with the device hit alone)."""
        full = PrefixHit(hit.block_ids, None, 0, hit.block_size)
        # Tier lookups (Redis round trips) only for a sequence that can be admitted at all.
        need = self.blocks.num_blocks_needed(None, min(seq.num_tokens, full.num_cached_tokens + budget), hit=full)
        if not self.blocks.can_allocate(need):
            return None, 0
        load = self.tiers.extend(seq.token_ids, seq.cache_salt, hit)
        if load is None:
            return None, 0
        cached = load.num_cached_tokens
        num_new = min(seq.num_tokens - cached, budget)
        alloc = self.blocks.allocate(
            seq.seq_id, cached + num_new, hit=load.hit, cache_salt=seq.cache_salt, token_ids=seq.token_ids,
        )
        if alloc is None:
            return None, 0
        first = len(load.hit.block_ids)
        self.tiers.commit_load(load, self.blocks.block_ids(seq.seq_id)[first:first + load.num_blocks])
        return alloc, cached

    def _swap_in(self, seq: Sequence, budget: int):
        """Readmit a swapped-out sequence where it stopped: full blocks still cached on the device
        are shared, the rest of its blocks are copied back from host memory."""
        saved = self.tiers.swapped_tokens(seq.seq_id)
        bs = self.blocks.block_size
        device = self.blocks.match_prefix(seq.token_ids[: saved + 1], cache_salt=seq.cache_salt)
        hit = PrefixHit(device.block_ids, None, 0, bs)
        num_new = min(seq.num_tokens - saved, budget)
        alloc = self.blocks.allocate(
            seq.seq_id, saved + num_new, hit=hit, cache_salt=seq.cache_salt, token_ids=seq.token_ids,
        )
        if alloc is None:
            return None
        self.tiers.swap_in(seq.seq_id, self.blocks.block_ids(seq.seq_id), len(hit.block_ids))
        seq.num_computed_tokens = saved
        self.inflight.admitted(seq, hit)
        return self._chunk(seq, num_new), alloc.copies
