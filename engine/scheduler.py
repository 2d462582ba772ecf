"""Scheduler: decides, each step, which sequences advance by how many tokens, and owns the step's
bookkeeping around the forward.

    schedule()                 -> SchedulerOutput (plain data: rows, block copies, tier transfers)
    update_from_output(o, r)   after the runner: advance num_computed_tokens, commit newly full
                               blocks to the prefix cache, fork n>1 samples, release copy sources,
                               end the tier step and write new blocks through to Redis
    fork(parent, child) / finish(seq)   beams and finished / aborted sequences

Every kind of progress -- prefill, chunked prefill, prefix-cache hit, decode -- is "advance
num_computed_tokens by num_new_tokens" within a token budget. Only the model runner builds tensors.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.inflight_prefixes import InflightPrefixes
from engine.retention import RetentionPolicy
from engine.scheduler_output import PromptLogprobsSpec, SampleSpec, ScheduledRow, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.speculative.drafter import Drafter
from prefix_cache import BlockManager, KVTiers, NoFreeBlocksError, PrefixHit

if TYPE_CHECKING:  # the runner's output type only: the scheduler never touches tensors
    from engine.model_runner import RunnerOutput


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str  # "fcfs" | "priority"


_DEFERRED = object()


class Scheduler:
    """Owns the waiting and running queues and the step's bookkeeping; the BlockManager owns every
    block id, the KV tiers every host slot.

    Invariants: a sequence is in exactly one of waiting / running / (finished, dropped);
    running sequences hold blocks covering their num_computed_tokens; waiting ones hold none;
    ``seqs`` maps the id of every waiting or running sequence to it.
    """

    def __init__(
        self, limits: SchedulerLimits, blocks: BlockManager, tiers: KVTiers, *,
        eos_token_ids: Seq[int] = (), preemption_mode: str = "recompute",
        read_kv_blocks: Callable[[list[int]], list] | None = None, drafter: Drafter | None = None,
        retention: RetentionPolicy | None = None,
    ) -> None:
        self.limits = limits
        self.blocks = blocks
        self.tiers = tiers  # host / Redis tiers (a KVTiers with neither when off): loads, swaps, write-through
        self.retention = retention  # what stays cached past a request's end (engine/retention.py)
        self.eos_token_ids = tuple(eos_token_ids)
        self.preemption_mode = preemption_mode
        self._read_kv_blocks = read_kv_blocks  # the runner's pool reader, for Redis write-through
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.seqs: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.inflight = InflightPrefixes(blocks)
        self._finished_ids: list[str] = []  # told to the runner with the next output
        self.drafter = drafter  # speculative decoding's draft tokens (None: off)

    # -- queues -----------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple[int, ...]:
        return seq.sort_key(self.limits.policy)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        bisect.insort(self.waiting, seq, key=self._key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child continues from the parent's tokens: it shares the parent's blocks (copy-on-write)
        and runs; if the parent was preempted after its step, the child waits and recomputes (mostly
        prefix-cache hits)."""
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        if not self.blocks.has_seq(parent.seq_id):
            child.num_computed_tokens = 0
            self.add(child)
            return
        self.blocks.fork(parent.seq_id, child.seq_id)
        child.status = SequenceStatus.RUNNING
        self.seqs[child.seq_id] = child
        bisect.insort(self.running, child, key=self._key)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it and release its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.blocks.has_seq(seq.seq_id):
            if self.retention is not None:
                seq.num_retained_tokens = self.retention.finished(seq)
            self.blocks.free(seq.seq_id)
        self.tiers.drop_swap(seq.seq_id)
        self.inflight.forget(seq)
        if self.drafter is not None:
            self.drafter.finished(seq)
        if self.seqs.pop(seq.seq_id, None) is not None:
            self._finished_ids.append(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the decision -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        self.tiers.begin_step()
        rows: list[ScheduledRow] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []

        # 1. Running sequences first, most important first: decodes (with their drafts) and unfinished prefills.
        drafts = self._drafts(budget)
        scheduled: set[str] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:  # a beam waiting for its siblings' candidates
                continue
            draft = drafts.get(seq.seq_id, ())[: budget - num_new]
            grown = self._grow_or_preempt(seq, num_new + len(draft), scheduled, preempted)
            if grown is None:
                continue
            copies.extend(grown)
            rows.append(self._row(seq, num_new, draft))
            num_new += len(draft)
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
            row, new_copies = admitted
            self.waiting.remove(seq)
            bisect.insort(self.running, seq, key=self._key)
            seq.status = SequenceStatus.RUNNING
            rows.append(row)
            copies.extend(new_copies)
            budget -= row.num_new_tokens

        rows.sort(key=lambda r: r.num_new_tokens - r.num_draft_tokens != 1)  # decodes first (stable: priority order kept)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(tuple(rows), tuple(copies), tuple(s.seq_id for s in preempted),
                               self.tiers.take_transfers(), finished)

    def _drafts(self, budget: int) -> dict[str, tuple[int, ...]]:
        """Speculative decoding: the draft tokens of decoding sequences this step (none when off)."""
        if self.drafter is None:
            return {}
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        return self.drafter.draft_step(decoding, budget - len(decoding)) if decoding else {}

    # -- decode bursts (engine/decode_burst.py) ------------------------------------------
    def reserve_burst(self, output: SchedulerOutput, num_steps: int) -> tuple[SchedulerOutput, int]:
        """Grow every row's blocks to cover ``num_steps`` tokens from its start (a decode burst's steps):
        the output with those block tables and ``num_steps``, or the output unchanged and 1 where a KV tier is on
        (a block evicted here would be demoted after the burst overwrote it) or the pool cannot hold them all."""
        if num_steps <= 1 or self.tiers.enabled:
            return output, 1
        grown: list[ScheduledRow] = []
        for row in output.rows:
            if self.blocks.allocate(row.seq_id, row.start + num_steps) is None:
                for done in grown:
                    self.blocks.trim(done.seq_id, done.end)
                return output, 1
            grown.append(row)
        rows = tuple(replace(row, block_ids=tuple(self.blocks.block_ids(row.seq_id))) for row in output.rows)
        return replace(output, rows=rows), num_steps

    def continue_burst(self, output: SchedulerOutput) -> SchedulerOutput:
        """The next step of a decode burst: the rows of ``output``'s sequences still running, each one token
        on (the token the last step appended), in the same order; their blocks were reserved."""
        self.tiers.begin_step()
        rows = tuple(self._row(self.seqs[row.seq_id], 1) for row in output.rows if row.seq_id in self.seqs)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(rows, (), (), self.tiers.take_transfers(), finished)

    # -- after the forward ----------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: RunnerOutput) -> None:
        """The runner executed ``output``: every row's tokens now have KV. Advance progress, cache the
        newly full blocks, fork n>1 samples from their root, then close the step: copy sources and
        tier pins released, the cost model fed, new blocks written through to Redis. A row's rejected
        drafts leave nothing behind: progress stops after the accepted ones and blocks past them go back."""
        for row in output.rows:
            seq = self.seqs[row.seq_id]
            if row.num_draft_tokens:
                self._verified(seq, row, result.num_accepted[row.seq_id])
                continue
            seq.num_computed_tokens = row.end
            self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if row.samples and seq.pending_forks:  # n>1: the prompt is computed, the samples fork now
                for child in seq.pending_forks:
                    child.num_cached_tokens = seq.num_cached_tokens
                    self.fork(seq, child)
                seq.pending_forks = []
        self.tiers.record_step(result.forward_seconds, output.num_batched_tokens, result.transfer_timings)
        self.end_step(ok=True)

    def _verified(self, seq: Sequence, row: ScheduledRow, accepted: int) -> None:
        """KV is valid through the last accepted draft (the sample after it has none yet). The accepted
        drafts are the model's own tokens, so their full blocks are cached; nothing after them is."""
        seq.num_computed_tokens = row.end - row.num_draft_tokens + accepted
        self.blocks.commit(seq.seq_id, seq.token_ids + list(row.draft_token_ids[:accepted]), seq.num_computed_tokens)
        self.blocks.trim(seq.seq_id, seq.num_computed_tokens)
        self.drafter.observe(seq.seq_id, row.num_draft_tokens, accepted)

    def end_step(self, ok: bool) -> None:
        """Close the step, run or failed: copy sources and tier pins are held only until the forward."""
        self.blocks.release_copy_sources()
        self.tiers.end_step(ok)
        if ok:
            self._write_through()

    def _write_through(self) -> None:
        """Blocks cached this step go to Redis: read their bytes now, while they are immutable."""
        writes = self.tiers.take_writes()
        if writes and self._read_kv_blocks is not None:
            self.tiers.submit_writes(writes, self._read_kv_blocks([w.block_id for w in writes]))

    # -- rows -------------------------------------------------------------------------
    def _row(self, seq: Sequence, num_new: int, draft: tuple[int, ...] = ()) -> ScheduledRow:
        start = seq.num_computed_tokens
        end = start + num_new
        samples = ()
        if end == seq.num_tokens:  # the chunk reaches the last known token: its logits pick the next
            samples = tuple(self._sample_spec(s) for s in (seq, *seq.pending_forks))
        return ScheduledRow(seq.seq_id, start, tuple(seq.token_ids[start:end]) + draft,
                            tuple(self.blocks.block_ids(seq.seq_id)), samples,
                            self._prompt_logprobs_spec(seq, start, end), len(draft),
                            max(0, min(end, seq.num_prompt_tokens) - start))

    def _sample_spec(self, seq: Sequence) -> SampleSpec:
        p = seq.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            banned = tuple(p.stop_token_ids or ()) + (() if p.ignore_eos else self.eos_token_ids)
        # Beam search ranks each beam's best 2*width continuations by raw logprob.
        num_top = 2 * p.n if p.use_beam_search else p.logprobs
        if p.needs_penalties:
            return SampleSpec(seq.seq_id, p, banned, num_top, tuple(seq.token_ids), seq.num_prompt_tokens,
                              seq.num_output_tokens)
        return SampleSpec(seq.seq_id, p, banned, num_top, output_index=seq.num_output_tokens)

    @staticmethod
    def _prompt_logprobs_spec(seq: Sequence, start: int, end: int) -> PromptLogprobsSpec | None:
        if seq.prompt_logprobs is None:
            return None
        # Logits at position p score prompt token p+1, so positions up to num_prompt-2 count. Tokens
        # scored before a preemption are not scored again (a recomputed chunk may cover them).
        first = max(start + 1, len(seq.prompt_logprobs))
        last = min(end, seq.num_prompt_tokens - 1)
        if first > last:
            return None
        return PromptLogprobsSpec(seq.params.prompt_logprobs, first, tuple(seq.token_ids[first:last + 1]))

    @staticmethod
    def _reusable_prefix(seq: Sequence) -> int | None:
        """How many leading tokens a cache hit may cover: None = any. A token's prompt logprob needs the
        logits of the position before it, which a cache hit would skip computing, so a sequence still
        scoring its prompt reuses only the tokens before the first position whose logits it needs."""
        scored = seq.prompt_logprobs
        if scored is None or len(scored) >= seq.num_prompt_tokens:
            return None
        return len(scored) - 1  # scored[0] is the first token's None: position 0 is always needed then

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
        if self.preemption_mode == "swap" and saved > 0:
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
        if self.tiers.swapped_tokens(seq.seq_id) is not None:
            return self._swap_in(seq, budget)
        reusable = self._reusable_prefix(seq)
        if reusable is not None:
            # Still scoring its prompt: reuse only what needs no logits (+1: match_prefix never
            # covers the last token it is given). Its blocks are still committed for later requests.
            hit = self.blocks.match_prefix(seq.token_ids[:reusable + 1], cache_salt=seq.cache_salt)
        else:
            hit = self.blocks.match_prefix(seq.token_ids, cache_salt=seq.cache_salt)
            if self.inflight.should_defer(seq, hit):
                return _DEFERRED
        alloc, cached = None, hit.num_cached_tokens
        if self.tiers.enabled and reusable is None:
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
        return self._row(seq, min(seq.num_tokens - cached, budget)), alloc.copies

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
        return self._row(seq, num_new), alloc.copies
