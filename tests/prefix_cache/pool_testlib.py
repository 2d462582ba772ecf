"""Helpers for the block pool's tests: cache a chain of blocks, release one."""
from prefix_cache import BlockPool, chain_keys

NS = b"ns"


def cache_chain(pool: BlockPool, tokens, parent=None):
    """Allocate blocks for the full blocks of ``tokens`` and cache them as a chain (ref 1 each)."""
    bs = pool.block_size
    parent_key = None if parent is None else pool.index.key_of(parent)
    ids = []
    for i, key in enumerate(chain_keys(tokens, bs, (NS,), parent=parent_key)):
        b = pool.allocate()
        pool.register(b, key, parent, tokens[i * bs : (i + 1) * bs], NS)
        parent = b
        ids.append(b)
        pool.check_integrity()
    return ids


def release(pool: BlockPool, ids):
    for b in reversed(ids):
        pool.decref(b)
        pool.check_integrity()
