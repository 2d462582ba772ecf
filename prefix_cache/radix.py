"""Radix index of cached full blocks.

A node is one cached block; its parent is the cached block holding the tokens just before it.
The tree is keyed twice: globally by block key (walking a prompt from the root is one dict
lookup per block), and per parent by the first token of each child (the partial-block match
looks only at children that share at least one token with the prompt).  First-level blocks hang
off a per-namespace root; a namespace is the encoded extra keys (model fingerprint, dtype,
cache_salt), so tenants with different salts never see each other's blocks even in a partial
match, where no key is compared.

The index knows nothing about reference counts; ``BlockPool`` decides what may be removed.

Invariants (checked by ``check_integrity``):
  * key -> node and block -> node describe the same set of nodes;
  * a node's parent is in the index and lists the node among its children;
  * a node's children all share its namespace, and first-level nodes are listed under their
    namespace root;
  * every node holds exactly ``block_size`` tokens (only full blocks are cached).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .hashing import KEY_SIZE, BlockKey

# first token id -> ordered set (dict with None values) of child block ids
_Children = dict[int, dict[int, None]]


class _Node:
    """One cached block.  Mutable only through RadixIndex."""

    __slots__ = ("block_id", "key", "parent", "token_ids", "ns", "children", "num_children")

    def __init__(
        self, block_id: int, key: BlockKey, parent: int | None, token_ids: tuple[int, ...], ns: bytes
    ) -> None:
        self.block_id = block_id
        self.key = key
        self.parent = parent
        self.token_ids = token_ids
        self.ns = ns
        self.children: _Children = {}
        self.num_children = 0


def _add_child(children: _Children, first_token: int, block_id: int) -> None:
    children.setdefault(first_token, {})[block_id] = None


def _remove_child(children: _Children, first_token: int, block_id: int) -> None:
    bucket = children[first_token]
    del bucket[block_id]
    if not bucket:
        del children[first_token]


class RadixIndex:
    """Tree of cached full blocks, addressable by key and by block id.

    Invariant: only leaves can be removed, so a block's parent is never removed before its
    children.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._by_key: dict[BlockKey, _Node] = {}
        self._by_block: dict[int, _Node] = {}
        self._roots: dict[bytes, _Children] = {}
        self._root_counts: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._by_block

    def block_ids(self) -> Iterator[int]:
        return iter(self._by_block)

    def lookup(self, key: BlockKey) -> int | None:
        """Block id cached under ``key``, or None."""
        node = self._by_key.get(key)
        return None if node is None else node.block_id

    def key_of(self, block_id: int) -> BlockKey:
        return self._by_block[block_id].key

    def parent_of(self, block_id: int) -> int | None:
        return self._by_block[block_id].parent

    def tokens_of(self, block_id: int) -> tuple[int, ...]:
        return self._by_block[block_id].token_ids

    def ns_of(self, block_id: int) -> bytes:
        return self._by_block[block_id].ns

    def is_leaf(self, block_id: int) -> bool:
        return self._by_block[block_id].num_children == 0

    def num_children(self, block_id: int) -> int:
        return self._by_block[block_id].num_children

    def confirm(self, block_id: int, parent: int | None, token_ids: Sequence[int], ns: bytes) -> bool:
        """True iff ``block_id`` is cached as the child of ``parent`` holding exactly ``token_ids``.

        This is what turns a key hit into a real hit: a hash collision cannot pass it because
        the tokens and the (recursively confirmed) parent are compared, not just the key.
        """
        node = self._by_block.get(block_id)
        return (
            node is not None
            and node.parent == parent
            and node.ns == ns
            and node.token_ids == tuple(token_ids)
        )

    def children_starting_with(self, parent: int | None, ns: bytes, first_token: int) -> list[int]:
        """Cached children of ``parent`` (None = the namespace root) whose first token matches."""
        if parent is None:
            children = self._roots.get(ns)
            if children is None:
                return []
        else:
            node = self._by_block[parent]
            if node.ns != ns:
                return []
            children = node.children
        return list(children.get(first_token, ()))

    def insert(
        self, block_id: int, key: BlockKey, parent: int | None, token_ids: Sequence[int], ns: bytes
    ) -> None:
        """Add a full block as a child of ``parent`` (None: first block of its namespace)."""
        tokens = tuple(token_ids)
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(tokens)} tokens")
        if len(key) != KEY_SIZE:
            raise ValueError(f"key must be {KEY_SIZE} bytes")
        if key in self._by_key:
            raise ValueError("key already cached")
        if block_id in self._by_block:
            raise ValueError(f"block {block_id} already cached")
        node = _Node(block_id, key, parent, tokens, ns)
        if parent is None:
            _add_child(self._roots.setdefault(ns, {}), tokens[0], block_id)
            self._root_counts[ns] = self._root_counts.get(ns, 0) + 1
        else:
            parent_node = self._by_block.get(parent)
            if parent_node is None:
                raise ValueError(f"parent block {parent} is not cached")
            if parent_node.ns != ns:
                raise ValueError("child and parent belong to different namespaces")
            _add_child(parent_node.children, tokens[0], block_id)
            parent_node.num_children += 1
        self._by_key[key] = node
        self._by_block[block_id] = node

    def remove(self, block_id: int) -> int | None:
        """Remove a leaf; returns its parent (None for a first-level block)."""
        node = self._by_block[block_id]
        if node.num_children:
            raise ValueError(f"block {block_id} has cached children; remove them first")
        first = node.token_ids[0]
        if node.parent is None:
            _remove_child(self._roots[node.ns], first, block_id)
            self._root_counts[node.ns] -= 1
            if not self._root_counts[node.ns]:
                # drop empty namespaces so per-tenant salts do not accumulate forever
                del self._root_counts[node.ns]
                del self._roots[node.ns]
        else:
            parent_node = self._by_block[node.parent]
            _remove_child(parent_node.children, first, block_id)
            parent_node.num_children -= 1
        del self._by_key[node.key]
        del self._by_block[block_id]
        return node.parent

    def check_integrity(self) -> None:
        if len(self._by_key) != len(self._by_block):
            raise AssertionError("key map and block map differ in size")
        for key, node in self._by_key.items():
            if node.key != key or self._by_block.get(node.block_id) is not node:
                raise AssertionError(f"key -> block mapping inconsistent for block {node.block_id}")
        listed = 0
        for ns, children in self._roots.items():
            count = 0
            for first, bucket in children.items():
                if not bucket:
                    raise AssertionError("empty child bucket under a root")
                for child in bucket:
                    node = self._by_block.get(child)
                    if node is None or node.parent is not None or node.ns != ns or node.token_ids[0] != first:
                        raise AssertionError(f"root child {child} is inconsistent")
                    count += 1
            if count != self._root_counts.get(ns) or count == 0:
                raise AssertionError("root child count mismatch")
            listed += count
        if set(self._roots) != set(self._root_counts):
            raise AssertionError("root maps disagree")
        for node in self._by_block.values():
            if len(node.token_ids) != self.block_size:
                raise AssertionError(f"block {node.block_id} is not full")
            count = 0
            for first, bucket in node.children.items():
                if not bucket:
                    raise AssertionError("empty child bucket")
                for child in bucket:
                    child_node = self._by_block.get(child)
                    if (
                        child_node is None
                        or child_node.parent != node.block_id
                        or child_node.ns != node.ns
                        or child_node.token_ids[0] != first
                    ):
                        raise AssertionError(f"child {child} of block {node.block_id} is inconsistent")
                    count += 1
            if count != node.num_children:
                raise AssertionError(f"child count of block {node.block_id} is wrong")
            listed += count
            if node.parent is not None and node.parent not in self._by_block:
                raise AssertionError(f"parent of cached block {node.block_id} is not cached")
        if listed != len(self._by_block):
            raise AssertionError("some cached blocks are not reachable from a root")
