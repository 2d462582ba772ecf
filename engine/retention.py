"""What the engine keeps cached past a request's end: an agent's context across a tool call, the prefix up to
an Anthropic ``cache_control`` breakpoint.

An agent's conversation pauses while a tool runs, then comes back with the whole history plus the tool's
result. Under memory pressure LRU evicts exactly those paused contexts first (whatever ran during the pause
is more recent). Retention reorders eviction instead of pinning (prefix_cache/block_pool.py): retained
blocks go only after every other evictable block, so no request is ever refused for it; evicted anyway,
they are demoted to the host tier like any evicted block, and a Redis tier already holds every cached block
written through.

    policy = RetentionPolicy(blocks, idle_ttl_s=300)
    policy.finished(seq)   # before the scheduler frees the sequence's blocks -> tokens newly retained

Per request (SamplingParams):
  * ``prompt_cache_key`` (OpenAI): a session. The context of the key's latest request (prompt and output, its
    full blocks) is retained for ``idle_ttl_s`` (``prompt_cache_retention="24h"``: 24 hours); the key's
    previous context is released (it is a prefix of the new one in an agent loop, and stays retained as such).
  * ``cache_breakpoints`` (Anthropic ``cache_control``): ((prompt tokens, ttl seconds), ...): the prompt's
    prefix up to each breakpoint is retained for its TTL.
Keys are per ``cache_salt``: a tenant's key never releases another's context.

Long retention and Redis. A retention longer than ``idle_ttl_s`` (``--prompt-cache-ttl``, 300 s: OpenAI's
``"24h"``, Anthropic's ``"1h"``, a ``/v1/cache/retain`` ttl above it) outlives what the device pool and the host
tier can be trusted to keep, so with a Redis tier its blocks are also kept there at least that long
(``KVTiers.persist``: queued for the tier's writer, never blocking a step; entries already in Redis get their
expiry extended, absent ones are written from the device pool). A replica that restarts, or another one, finds
the context in Redis. Only the retained chain's blocks go: cached, hence full and computed (verified tokens).
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from engine.sampling_params import RETENTION_MAX_S
from engine.sequence import Sequence
from prefix_cache import BlockManager, KVTiers


@dataclass
class _Session:
    request_id: str
    blocks: dict[int, object]  # block id -> the key it was cached under when retained (ids are reused)


class RetentionPolicy:
    """Retains finished sequences' contexts as their requests asked (module docstring).

    Invariant: ``_sessions`` holds, per (cache_salt, prompt_cache_key), the blocks retained for that key's latest
    request; nothing else is released by a key."""

    def __init__(self, blocks: BlockManager, *, idle_ttl_s: float, tiers: KVTiers | None = None) -> None:
        self.blocks = blocks
        self.idle_ttl_s = idle_ttl_s
        self._sessions: dict[tuple[str | None, str], _Session] = {}
        # long retentions are kept in Redis too (module docstring); None: no Redis tier
        self._tiers = tiers if tiers is not None and tiers.remote is not None else None

    def finished(self, seq: Sequence) -> int:
        """Retain what ``seq``'s request asked for, while it still holds its blocks; the prompt tokens it newly
        retained beyond what it read from the cache (Anthropic's ``cache_creation_input_tokens``)."""
        params = seq.params
        if not self.blocks.has_seq(seq.seq_id) or not (params.prompt_cache_key or params.cache_breakpoints):
            return 0
        created = 0
        long: dict[int, float] = {}  # block -> the longest retention asked for it, beyond idle_ttl_s
        for num_tokens, ttl_s in params.cache_breakpoints:
            # tokens the request read from the cache are not created (Anthropic counts them once, as read)
            chain, new = self.blocks.retain_prefix(seq.seq_id, min(num_tokens, seq.num_prompt_tokens), ttl_s,
                                                   from_token=seq.num_cached_tokens)
            created += new * self.blocks.block_size
            self._note_long(long, chain, ttl_s)
        if params.prompt_cache_key:
            created += self._retain_session(seq, (seq.cache_salt, params.prompt_cache_key), long)
        if long:
            self._tiers.persist(long)
        return created

    def _note_long(self, long: dict[int, float], chain: list[int], ttl_s: float) -> None:
        if self._tiers is not None and ttl_s > self.idle_ttl_s:
            for b in chain:
                long[b] = max(ttl_s, long.get(b, 0.0))

    def _retain_session(self, seq: Sequence, key: tuple[str | None, str], long: dict[int, float]) -> int:
        ttl_s = RETENTION_MAX_S if seq.params.prompt_cache_retention == "24h" else self.idle_ttl_s
        _, new = self.blocks.retain_prefix(seq.seq_id, seq.num_prompt_tokens, ttl_s, from_token=seq.num_cached_tokens)
        chain, _ = self.blocks.retain_prefix(seq.seq_id, seq.num_computed_tokens, ttl_s)
        self._note_long(long, chain, ttl_s)
        held = {b: self.blocks.key_of(b) for b in chain}
        previous = self._sessions.get(key)
        if previous is not None and previous.request_id == seq.request_id:  # n > 1: every sample's context
            held = previous.blocks | held
        elif previous is not None:
            self.blocks.release_blocks([b for b, k in previous.blocks.items()
                                        if b not in held and self.blocks.key_of(b) == k])
        self._sessions[key] = _Session(seq.request_id, held)
        if len(self._sessions) > 4 * self.blocks.num_blocks:
            self._forget_lapsed()
        return new * self.blocks.block_size

    def _forget_lapsed(self) -> None:
        """Drop sessions none of whose blocks is retained any more (expired, lapsed or evicted): bounded memory."""
        self._sessions = {k: s for k, s in self._sessions.items() if self._retained(s)}

    def _retained(self, session: _Session) -> int:
        return sum(self.blocks.is_retained(b) and self.blocks.key_of(b) == k for b, k in session.blocks.items())

    def sessions(self) -> dict[Hashable, int]:
        """(cache_salt, key) -> blocks retained for it now (introspection, tests)."""
        return {k: self._retained(s) for k, s in self._sessions.items()}
