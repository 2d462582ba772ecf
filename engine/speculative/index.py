"""Token indexes the drafts come from: where each short run of tokens occurred, so that the continuation
after an earlier occurrence of a sequence's last tokens can be proposed as its next tokens.

    SequenceIndex   one sequence's own tokens, indexed as they grow (prompt lookup)
    SharedIndex     finished requests' prompts and outputs, per cache_salt, oldest forgotten first

Both map a key (the ``key_len`` tokens ending at a position) to the positions after it, newest last;
``candidates()`` extends each match backwards to its full length, so the longest match wins.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_CANDIDATES = 8  # newest positions of a key looked at (a frequent key, ", the", has hundreds)


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
    ``key_len`` tokens are the query, not a candidate)."""

    def __init__(self, key_len: int) -> None:
        self.key_len = key_len
        self.positions: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # positions [key_len, indexed) are in ``positions``

    def candidates(self, tokens: list[int], max_length: int) -> list[Match]:
        k = self.key_len
        for end in range(max(self.indexed, k), len(tokens)):  # end = len(tokens) is the query itself
            self.positions.setdefault(tuple(tokens[end - k:end]), []).append(end)
        self.indexed = max(self.indexed, len(tokens))
        if len(tokens) < k:
            return []
        ends = self.positions.get(tuple(tokens[-k:]), ())
        return [Match(tokens, e, _match_length(tokens, e, tokens, max_length)) for e in ends[-MAX_CANDIDATES:]]


class SharedIndex:
    """Finished requests' token lists (prompt and output), per namespace (cache_salt): a draft never
    crosses tenants. At most ``max_requests`` lists and ``max_tokens`` tokens are held; the oldest go first."""

    def __init__(self, key_len: int, max_requests: int, max_tokens: int = 1 << 20) -> None:
        self.key_len, self.max_requests, self.max_tokens = key_len, max_requests, max_tokens
        self.docs: OrderedDict[int, tuple[object, list[int]]] = OrderedDict()  # id -> (namespace, tokens)
        self.positions: dict[tuple[object, tuple[int, ...]], list[tuple[int, int]]] = {}  # -> (doc id, end)
        self.num_tokens = 0
        self._next_id = 0

    def add(self, namespace: object, tokens: list[int]) -> None:
        if self.max_requests == 0 or len(tokens) <= self.key_len or len(tokens) > self.max_tokens:
            return
        doc_id, self._next_id = self._next_id, self._next_id + 1
        tokens = list(tokens)
        self.docs[doc_id] = (namespace, tokens)
        self.num_tokens += len(tokens)
        k = self.key_len
        for end in range(k, len(tokens)):
            self.positions.setdefault((namespace, tuple(tokens[end - k:end])), []).append((doc_id, end))
        while len(self.docs) > self.max_requests or self.num_tokens > self.max_tokens:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        doc_id, (namespace, tokens) = self.docs.popitem(last=False)
        self.num_tokens -= len(tokens)
        k = self.key_len
        for end in range(k, len(tokens)):
            key = (namespace, tuple(tokens[end - k:end]))
            entries = self.positions.get(key)
            if entries:
                entries[:] = [e for e in entries if e[0] != doc_id]
                if not entries:
                    del self.positions[key]

    def candidates(self, namespace: object, query: list[int], max_length: int) -> list[Match]:
        if len(query) < self.key_len:
            return []
        entries = self.positions.get((namespace, tuple(query[-self.key_len:])), ())
        out = []
        for doc_id, end in entries[-MAX_CANDIDATES:]:
            doc = self.docs[doc_id][1]
            out.append(Match(doc, end, _match_length(doc, end, query, max_length)))
        return out

    def check_integrity(self) -> None:
        assert len(self.docs) <= max(self.max_requests, 0) and self.num_tokens <= self.max_tokens
        assert self.num_tokens == sum(len(t) for _, t in self.docs.values())
        for (namespace, _), entries in self.positions.items():
            for doc_id, _ in entries:
                assert self.docs[doc_id][0] == namespace, "an index entry points across namespaces"
