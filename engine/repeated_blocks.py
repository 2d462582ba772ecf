"""Ending a constrained output when it repeats itself block for block.

Small models under a "write one or more tool calls" grammar tend to write the same call again and
again until max_tokens. `StructuredOutputsParams(stop_on_repeated_block=(open, close))` ends such a
sequence (finish_reason "stop") as soon as it completes a block, from `open` to the `close` that ends
it, identical byte for byte to one it already wrote. A block ends where the output ends with `close`
and the grammar is complete, so a `close` inside a JSON string does not count; the first `open` after
the previous block starts the next one. The repeated block stays in the output text: the tool-call
parser (engine/tool_calls/parsing.py) reports no call twice. (A token that runs past `close` hides the
block's end from this check: no early stop then, and the parser still drops the repeat.)
"""
from __future__ import annotations


class RepeatedBlocks:
    """One sequence's output bytes and the blocks it completed."""

    def __init__(self, markers: tuple[str, str]) -> None:
        self.open, self.close = (m.encode() for m in markers)
        self.text = bytearray()
        self.block_from = 0  # where the text after the last complete block starts
        self.seen: set[bytes] = set()

    def repeated(self, token_bytes: bytes, grammar_complete: bool) -> bool:
        """Append one token's bytes; True when they complete a block written before."""
        self.text += token_bytes
        if not grammar_complete or not self.text.endswith(self.close):
            return False
        start = self.text.find(self.open, self.block_from)
        if start < 0:
            return False
        block = bytes(self.text[start:])
        self.block_from = len(self.text)
        if block in self.seen:
            return True
        self.seen.add(block)
        return False
