"""In-batch prefix sharing: don't compute the same prefix twice at once.

When many requests sharing a system prompt arrive together, the prefix cache alone cannot help
the ones admitted in the same step as the first: nothing is cached yet, so each would compute
the prefix itself. Like SGLang's in-batch prefix caching, a waiting request whose next uncached
block is being computed right now by an in-flight prefill waits for it; once that prefill has
committed its blocks, the request is admitted as a cache hit.
"""
from __future__ import annotations

from prefix_cache import BlockManager, PrefixHit

from engine.sequence import Sequence


class InflightPrefixes:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._keys: dict[str, list[bytes]] = {}  # seq_id -> keys of its full prompt blocks
        self._inflight: set[bytes] = set()

    def begin_step(self, running: list[Sequence]) -> None:
        """Collect the not-yet-computed prompt blocks of every running prefill."""
        self._inflight = set()
        for seq in running:
            self._add(seq, seq.num_computed_tokens)

    def should_defer(self, seq: Sequence, hit: PrefixHit) -> bool:
        keys = self._prompt_keys(seq)
        k = len(hit.block_ids)
        return k < len(keys) and keys[k] in self._inflight

    def admitted(self, seq: Sequence, hit: PrefixHit) -> None:
        self._add(seq, hit.num_cached_tokens)

    def forget(self, seq: Sequence) -> None:
        self._keys.pop(seq.seq_id, None)

    def _add(self, seq: Sequence, num_computed: int) -> None:
        if num_computed >= seq.num_prompt_tokens:
            return
        keys = self._prompt_keys(seq)
        self._inflight.update(keys[num_computed // self.blocks.block_size:])

    def _prompt_keys(self, seq: Sequence) -> list[bytes]:
        keys = self._keys.get(seq.seq_id)
        if keys is None:
            keys = self._keys[seq.seq_id] = self.blocks.block_keys(
                seq.token_ids[: seq.num_prompt_tokens], cache_salt=seq.cache_salt
            )
        return keys
