"""The BlockManager's interface types: a prefix hit, an allocation's result, cache statistics, the
listener the slower tiers register for cached and evicted blocks, and the stale-hit error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .hashing import BlockKey


class StaleHitError(ValueError):
    """The PrefixHit passed to allocate no longer describes cached blocks (evicted meanwhile)."""


class BlockListener(Protocol):
    """Told when a full block enters or leaves the device cache (the slower KV tiers listen).

    Both calls come while the block's KV is intact in the device pool; neither may call back into
    the BlockManager.  ``parent_key`` is None for the first block of a sequence; ``ns`` is the
    block's namespace (encoded extra keys, cache_salt included).
    """

    def block_cached(
        self, block_id: int, key: BlockKey, parent_key: BlockKey | None, token_ids: tuple[int, ...], ns: bytes
    ) -> None: ...

    def block_evicted(
        self, block_id: int, key: BlockKey, parent_key: BlockKey | None, token_ids: tuple[int, ...], ns: bytes
    ) -> None: ...


@dataclass(frozen=True)
class PrefixHit:
    """Result of ``match_prefix``: what a new sequence can reuse instead of recomputing.

    ``block_ids`` are full cached blocks to share, in order.  ``partial_src`` is a cached block
    whose first ``partial_tokens`` tokens continue the prompt; the sequence gets a private copy
    of it (copy-on-write at admission).  ``block_size`` is the manager's block size, so that
    ``num_cached_tokens`` can be computed from the hit alone.
    """

    block_ids: tuple[int, ...]
    partial_src: int | None
    partial_tokens: int
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not 0 <= self.partial_tokens < self.block_size:
            raise ValueError("partial_tokens must lie in [0, block_size)")
        if (self.partial_src is None) != (self.partial_tokens == 0):
            raise ValueError("partial_src is set exactly when partial_tokens > 0")

    @classmethod
    def empty(cls, block_size: int) -> PrefixHit:
        return cls((), None, 0, block_size)

    @property
    def num_cached_tokens(self) -> int:
        return len(self.block_ids) * self.block_size + self.partial_tokens


@dataclass(frozen=True)
class Allocation:
    """Block copies ``(src, dst)`` the model runner must perform BEFORE this step's forward."""

    copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters: prompt tokens queried and served from cache, blocks evicted."""

    queries: int
    hits: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
