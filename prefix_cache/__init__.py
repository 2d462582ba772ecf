"""Prefix cache: paged KV block pool, block hashing, radix index, copy-on-write, eviction, and the
slower tiers' bookkeeping (host slots, load-vs-recompute, swap, the Redis value format).

Pure Python (standard library + xxhash): usable and testable without torch or a model.  The one
module that talks to Redis, ``prefix_cache.redis_store``, is not imported here.
"""

from .block_pool import BlockPool, NoFreeBlocksError
from .hashing import BlockKey, block_key, chain_keys, encode_extra_keys
from .host_pool import HostKVPool
from .interface import Allocation, BlockListener, PrefixCacheStats, PrefixHit, StaleHitError
from .manager import BlockManager
from .radix import RadixIndex
from .tiers import KVTiers, KVTransfers, LoadCostModel, RemoteKVStore, TierLoad, TransferTimings

__all__ = [
    "Allocation",
    "BlockKey",
    "BlockListener",
    "BlockManager",
    "BlockPool",
    "HostKVPool",
    "KVTiers",
    "KVTransfers",
    "LoadCostModel",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "PrefixHit",
    "RadixIndex",
    "RemoteKVStore",
    "StaleHitError",
    "TierLoad",
    "TransferTimings",
    "block_key",
    "chain_keys",
    "encode_extra_keys",
]
