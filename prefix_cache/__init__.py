"""Prefix cache: paged KV block pool, block hashing, radix index, copy-on-write, eviction.

Pure Python (standard library + xxhash): usable and testable without torch or a model.
"""

from .block_pool import BlockPool, NoFreeBlocksError
from .hashing import BlockKey, block_key, chain_keys, encode_extra_keys
from .manager import Allocation, BlockManager, PrefixCacheStats, PrefixHit, StaleHitError
from .radix import RadixIndex

__all__ = [
    "Allocation",
    "BlockKey",
    "BlockManager",
    "BlockPool",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "PrefixHit",
    "RadixIndex",
    "StaleHitError",
    "block_key",
    "chain_keys",
    "encode_extra_keys",
]
