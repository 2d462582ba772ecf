"""Token indexes the drafts come from: where each short run of tokens occurred, so that the continuation
after an earlier occurrence of a sequence's last tokens can be proposed as its next tokens.

    SequenceIndex   one sequence's own tokens, indexed as they grow (prompt lookup)
    SharedIndex     finished requests' prompts and outputs, per cache_salt, oldest forgotten first

Both map a key (the ``key_len`` tokens ending at a position) to the positions after it, newest last;
``candidates()`` extends each match backwards to its full length, so the longest match wins.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

MAX_CANDIDATES = 8  # newest positions of a key looked at (a frequent key, ", the", has hundreds)
MAX_SHARED_TOKENS = 1 << 20  # tokens the shared index holds at most, over all namespaces
_MASK = (1 << 60) - 1  # keys stay small ints; numpy's uint64 arithmetic wraps mod 2**64, masked alike
_MULTIPLIER = 1_000_003


def _namespace_hash(namespace: object) -> int:
    return hash(namespace) & _MASK


def _position_keys(seed: int, tokens, k: int, start: int, stop: int) -> list[int]:
    """The key of every position ``end`` in [start, stop): a 60-bit polynomial hash of ``seed`` and the
    ``k`` tokens before ``end``. A long run is hashed at once with numpy (a tuple key per position cost
    ~8 us a token to index); a few new tokens in Python, with the same arithmetic."""
    count = stop - start
    if count <= 0:
        return []
    if count < 32:
        keys = []
        for end in range(start, stop):
            h = seed
            for token in tokens[end - k:end]:
                h = (h * _MULTIPLIER + token) & _MASK
            keys.append(h)
        return keys
    window = np.asarray(tokens[start - k:stop - 1], dtype=np.int64).astype(np.uint64)
    h = np.full(count, seed, dtype=np.uint64)
    for j in range(k):
        h = (h * np.uint64(_MULTIPLIER) + window[j:j + count]) & np.uint64(_MASK)
    return h.tolist()


@dataclass(frozen=True)
class Match:
    tokens: list[int]  # the document holding the earlier occurrence
    end: int  # position after the matched run: the continuation starts here
    length: int  # matched tokens


def _match_length(doc: list[int], end: int, query: list[int], limit: int) -> int:
    """How many tokens before ``end`` in ``doc`` equal the last tokens of ``query`` (at most ``limit``)."""
    n = 0
    q = len(query)
    while n < limit and n < end and n < q and doc[end - 1 - n] == query[q - 1 - n]:
        n += 1
    return n


class SequenceIndex:
    """A sequence's own tokens. Positions are indexed lazily up to the last token but one (the last
    ``key_len`` tokens are the query, not a candidate); keys as SharedIndex's, without a namespace."""

    def __init__(self, key_len: int) -> None:
        self.key_len = key_len
        self.positions: dict[int, list[int]] = {}  # key hash -> ends, oldest first
        self.indexed = 0  # positions [key_len, indexed) are in ``positions``

    def candidates(self, tokens: list[int], max_length: int) -> list[Match]:
        k, n = self.key_len, len(tokens)
        start = max(self.indexed, k)
        for end, key in enumerate(_position_keys(0, tokens, k, start, n), start):  # end = n is the query itself
            self.positions.setdefault(key, []).append(end)
        self.indexed = max(self.indexed, n)
        if n < k:
            return []
        ends = self.positions.get(_position_keys(0, tokens, k, n, n + 1)[0], ())
        found = (Match(tokens, e, _match_length(tokens, e, tokens, max_length)) for e in ends[-MAX_CANDIDATES:])
        return [m for m in found if m.length >= k]  # a shorter one is a hash collision


class SharedIndex:
    """Finished requests' token lists (prompt and output), per namespace (cache_salt): a draft never
    crosses tenants. At most ``max_requests`` lists and ``max_tokens`` tokens are held; the oldest go first.

    Compact, because a long-running server fills it: tokens are int32 arrays, a key is one int (a hash of
    the namespace and the key's tokens) and a key seen once holds one packed int (doc id << 32 | end), a
    list only from its second occurrence; keys are computed per document with numpy. Measured at 1M tokens
    (tokenized Python sources, RSS, this Zen 4): 65-80 bytes a token, against 155-189 with tuple keys and
    lists of (doc, end) tuples, and 1.0 us a token to add, against 8.5. A hash collision can only offer a candidate whose tokens then do
    not match (``_match_length`` reads the tokens) and never one of another namespace (checked per candidate)."""

    def __init__(self, key_len: int, max_requests: int, max_tokens: int = MAX_SHARED_TOKENS) -> None:
        self.key_len, self.max_requests, self.max_tokens = key_len, max_requests, max_tokens
        self.docs: OrderedDict[int, tuple[object, array]] = OrderedDict()  # id -> (namespace, tokens)
        self.positions: dict[int, int | list[int]] = {}  # key hash -> packed (doc id, end), oldest first
        self.num_tokens = 0
        self._next_id = 0

    def _keys(self, namespace: object, tokens: array) -> list[int]:
        """The key of every position ``end`` in [key_len, len(tokens))."""
        return _position_keys(_namespace_hash(namespace), tokens, self.key_len, self.key_len, len(tokens))

    def _query_key(self, namespace: object, query: list[int]) -> int:
        return _position_keys(_namespace_hash(namespace), query, self.key_len, len(query), len(query) + 1)[0]

    def add(self, namespace: object, tokens: list[int]) -> None:
        if self.max_requests == 0 or len(tokens) <= self.key_len or len(tokens) > self.max_tokens:
            return
        doc_id, self._next_id = self._next_id, self._next_id + 1
        held = array("i", tokens)
        self.docs[doc_id] = (namespace, held)
        self.num_tokens += len(held)
        positions = self.positions
        for end, key in enumerate(self._keys(namespace, held), self.key_len):
            entry = (doc_id << 32) | end
            was = positions.get(key)
            if was is None:
                positions[key] = entry
            elif type(was) is int:
                positions[key] = [was, entry]
            else:
                was.append(entry)
        while len(self.docs) > self.max_requests or self.num_tokens > self.max_tokens:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        doc_id, (namespace, tokens) = self.docs.popitem(last=False)
        self.num_tokens -= len(tokens)
        positions = self.positions
        for key in self._keys(namespace, tokens):
            was = positions.get(key)
            if was is None:
                continue
            if type(was) is int:
                if was >> 32 == doc_id:
                    del positions[key]
                continue
            # Entries are appended in document order and the oldest document goes first: its entries
            # lead the list (a frequent key's list is long; filtering it per position was quadratic).
            i = 0
            while i < len(was) and was[i] >> 32 == doc_id:
                i += 1
            if i == len(was):
                del positions[key]
            elif i:
                del was[:i]
                if len(was) == 1:
                    positions[key] = was[0]

    def candidates(self, namespace: object, query: list[int], max_length: int) -> list[Match]:
        k = self.key_len
        if len(query) < k:
            return []
        was = self.positions.get(self._query_key(namespace, query))
        if was is None:
            return []
        out = []
        for entry in ((was,) if type(was) is int else was[-MAX_CANDIDATES:]):
            held = self.docs.get(entry >> 32)
            if held is None or held[0] != namespace:  # a hash collision: never across tenants
                continue
            doc, end = held[1], entry & 0xFFFFFFFF
            if (length := _match_length(doc, end, query, max_length)) >= k:
                out.append(Match(doc, end, length))
        return out

    def check_integrity(self) -> None:
        assert len(self.docs) <= max(self.max_requests, 0) and self.num_tokens <= self.max_tokens
        assert self.num_tokens == sum(len(t) for _, t in self.docs.values())
        held = 0
        for key, was in self.positions.items():
            for entry in ((was,) if type(was) is int else was):
                namespace, tokens = self.docs[entry >> 32]
                end = entry & 0xFFFFFFFF
                assert self._query_key(namespace, tokens[:end]) == key, "an entry under another key"
                held += 1
        assert held == sum(max(0, len(t) - self.key_len) for _, t in self.docs.values()), "a position lost"
