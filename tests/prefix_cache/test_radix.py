import pytest

from prefix_cache import RadixIndex, chain_keys

NS = b"ns"


def build(index: RadixIndex, tokens, first_id, ns=NS, parent=None):
    """Insert the full blocks of ``tokens`` as a chain starting at block id ``first_id``."""
    bs = index.block_size
    parent_key = None if parent is None else index.key_of(parent)
    keys = chain_keys(tokens, bs, (ns,), parent=parent_key)
    ids = []
    for i, key in enumerate(keys):
        b = first_id + i
        index.insert(b, key, parent, tokens[i * bs : (i + 1) * bs], ns)
        parent = b
        ids.append(b)
        index.check_integrity()
    return ids, keys


def test_insert_lookup_and_confirm():
    index = RadixIndex(2)
    ids, keys = build(index, [1, 2, 3, 4], 0)
    assert ids == [0, 1]
    assert [index.lookup(k) for k in keys] == [0, 1]
    assert index.parent_of(1) == 0 and index.parent_of(0) is None
    assert index.confirm(1, 0, [3, 4], NS)
    assert not index.confirm(1, 0, [3, 5], NS)
    assert not index.confirm(1, None, [3, 4], NS)
    assert not index.confirm(1, 0, [3, 4], b"other")
    assert index.lookup(b"\x00" * 16) is None


def test_only_leaves_can_be_removed():
    index = RadixIndex(2)
    build(index, [1, 2, 3, 4], 0)
    with pytest.raises(ValueError):
        index.remove(0)
    assert index.remove(1) == 0
    assert index.is_leaf(0)
    assert index.remove(0) is None
    assert len(index) == 0
    index.check_integrity()


def test_children_by_first_token_and_namespace():
    index = RadixIndex(2)
    build(index, [1, 2, 3, 4], 0)
    build(index, [5, 6], 2, parent=0)
    build(index, [3, 9], 3, parent=0)
    build(index, [1, 2], 4, ns=b"tenant-b")
    assert index.children_starting_with(0, NS, 3) == [1, 3]
    assert index.children_starting_with(0, NS, 5) == [2]
    assert index.children_starting_with(0, NS, 7) == []
    assert index.children_starting_with(None, NS, 1) == [0]
    assert index.children_starting_with(None, b"tenant-b", 1) == [4]
    assert index.children_starting_with(None, b"nobody", 1) == []
    assert index.num_children(0) == 3


def test_insert_rejects_bad_input():
    index = RadixIndex(2)
    ids, keys = build(index, [1, 2], 0)
    with pytest.raises(ValueError):
        index.insert(5, keys[0], None, [1, 2], NS)  # key already cached
    with pytest.raises(ValueError):
        index.insert(0, b"k" * 16, None, [7, 8], NS)  # block already cached
    with pytest.raises(ValueError):
        index.insert(5, b"k" * 16, None, [7], NS)  # not a full block
    with pytest.raises(ValueError):
        index.insert(5, b"k" * 16, 9, [7, 8], NS)  # parent not cached
    with pytest.raises(ValueError):
        index.insert(5, b"k" * 16, 0, [7, 8], b"other")  # parent in another namespace
    index.check_integrity()


def test_empty_namespace_roots_are_dropped():
    index = RadixIndex(1)
    build(index, [1], 0, ns=b"salt-1")
    index.remove(0)
    assert index._roots == {} and index._root_counts == {}
