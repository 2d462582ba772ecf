"""The token reserve: a constrained output ends complete before max_tokens runs out.

A grammar guarantees that every prefix can still become valid, not that it becomes valid within
max_tokens: a model that keeps writing a string, an array or digits is cut off mid-value and the
client gets JSON that does not parse (or a tool call it cannot use). So each constrained sequence
keeps a reserve:

    walk  = a short token path from the matcher's state to a state where the grammar is complete
            (greedy: the grammar's forced tokens; else the first of a few closing tokens that the
            grammar allows, `"` first inside text, `}` `]` first elsewhere; else the lowest allowed token)
    left  = max_tokens - tokens generated so far
    left <= len(walk) + CLOSING_MARGIN  ->  the sequence follows the walk token by token (the grammar
            mask is narrowed to the walk's next token), then EOS: finish_reason "stop"

The margin absorbs what one freely chosen token can add to the walk (opening a string, an array, an
object and its required keys): the reserve holds as long as no single token adds more than
CLOSING_MARGIN tokens to it. The walk is computed only in the last MAX_CLOSING_TOKENS +
CLOSING_MARGIN tokens of the budget, and only while the grammar is incomplete. Where the grammar is
complete (free text before a tool call, a finished JSON value, after a tool call block) the model
goes on freely, except that a sequence whose last incomplete stretch (its last tool call) was longer
than what is left minus the margin ends there (EOS): another call like it would be cut off, or
closed with made-up arguments. The walk is greedy, not minimal: when max_tokens is below its
length the output stays cut off ("length"), as before.
The number and string policy that keeps walks short is in engine/json_schemas.py.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CLOSING_MARGIN = 8
MAX_CLOSING_TOKENS = 128
# Tried in order when the grammar forces nothing; the first one it allows is taken. Tokens that close
# more than one thing come first (a tokenizer without them as single tokens skips them).
_CLOSERS_IN_TEXT = ('"}', '"]', '",', '":', '"', "}", "]")
# A separator before "0": inside a number that cannot end the object yet (a required key still to come),
# "0" is also valid and would extend the number digit by digit up to its bound instead of ending it.
_CLOSERS = ("}", "]", '""', '":', '",', '"', ',"', ",", "0", "false", "null", "[]", "[", "{}", '{"', "{", ":")
_TEXT_PROBE = "Q"  # allowed inside strings and free text, never between JSON tokens


class Closers:
    """The closing candidates as token ids of one tokenizer (texts that are not one token are skipped)."""

    def __init__(self, ll_tokenizer, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.in_text = self._ids(ll_tokenizer, _CLOSERS_IN_TEXT)
        self.structural = self._ids(ll_tokenizer, _CLOSERS)
        self.probe = self._ids(ll_tokenizer, (_TEXT_PROBE,))

    @staticmethod
    def _ids(ll_tokenizer, texts: Sequence[str]) -> tuple[int, ...]:
        ids = (ll_tokenizer.tokenize_str(text) for text in texts)
        return tuple(t[0] for t in ids if len(t) == 1)


def closing_walk(matcher, closers: Closers, limit: int = MAX_CLOSING_TOKENS) -> list[int] | None:
    """Tokens that take `matcher` (not modified) to a complete state, or None when none was found
    within `limit` tokens."""
    m = matcher.deep_copy()
    walk: list[int] = []
    while not m.is_accepting():
        if len(walk) >= limit or m.is_error():
            return None
        forced = m.compute_ff_tokens()
        if forced:
            if not m.consume_tokens(forced):
                return None
            walk.extend(forced)
            continue
        in_text = bool(closers.probe) and m.validate_tokens(list(closers.probe)) == 1
        token = next((t for t in (closers.in_text if in_text else closers.structural)
                      if m.validate_tokens([t]) == 1), None)
        if token is None:
            token = _lowest_allowed(m, closers.eos_token_id)
        if token is None or not m.consume_token(token):
            return None
        walk.append(token)
    return walk


def _lowest_allowed(matcher, eos_token_id: int) -> int | None:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = np.flatnonzero(bits)
    allowed = allowed[allowed != eos_token_id]
    return int(allowed[0]) if allowed.size else None


class TokenReserve:
    """One sequence's budget, the length of its last unit and, once it is closing, the rest of its walk."""

    def __init__(self, max_tokens: int | None) -> None:
        self.left = max_tokens  # None: no budget to keep (the engine always sets max_tokens)
        self.walk: list[int] | None = None  # set once closing: forced tokens still to come
        self.last_unit = 0  # tokens of the last stretch from leaving a complete state to reaching one again
        self._unit_tokens: int | None = None  # tokens of the current stretch, while incomplete

    def consumed(self, token: int, complete: bool) -> None:
        """Record a token the matcher took; `complete`: whether the grammar is complete after it."""
        if self.left is not None:
            self.left -= 1
        if self.walk:
            if self.walk[0] == token:
                self.walk.pop(0)
            else:  # cannot happen under the narrowed mask; stop steering rather than force nonsense
                self.walk = None
        if not complete:
            self._unit_tokens = (self._unit_tokens or 0) + 1
        elif self._unit_tokens is not None:
            self.last_unit, self._unit_tokens = self._unit_tokens + 1, None

    def tokens_before_closing(self) -> int | None:
        """Tokens the sequence can take before the reserve may start steering it (None: no budget)."""
        if self.walk is not None:
            return 0
        if self.left is None:
            return None
        return self.left - max(MAX_CLOSING_TOKENS, self.last_unit) - CLOSING_MARGIN

    @property
    def closing(self) -> bool:
        """Walking a closing path (its tokens, in its own tokenization, are what comes next)."""
        return self.walk is not None

    def forced_token(self, matcher, closers: Closers) -> int | None:
        """The token this sequence must take next, or None to let the grammar's mask decide."""
        if self.walk is not None:
            return self.walk[0] if self.walk else closers.eos_token_id
        if self.left is None or self.left > max(MAX_CLOSING_TOKENS, self.last_unit) + CLOSING_MARGIN:
            return None
        if matcher.is_accepting():
            # Complete here. Another unit like the last one (a second tool call) would not fit: end now
            # rather than open one that max_tokens cuts off or the walk closes with made-up values.
            if self.last_unit and self.left < self.last_unit + CLOSING_MARGIN:
                self.walk = []
                return closers.eos_token_id
            return None
        walk = closing_walk(matcher, closers)
        if walk is None or self.left > len(walk) + CLOSING_MARGIN:
            return None
        self.walk = walk
        return walk[0]
