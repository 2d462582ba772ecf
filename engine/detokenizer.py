"""Output text and stop-string handling for one sequence at a time.

The whole output is re-decoded each step (outputs are short next to the model's cost, and a
full decode never splits multi-byte characters wrongly); only the newest region is searched for
stop strings.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass(frozen=True)
class StopMatch:
    stop: str
    text: str  # the output text, cut at (or after, with include_stop_str_in_output) the stop string


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, seq: Sequence) -> str:
        p = seq.params
        return self.tokenizer.decode(
            seq.output_token_ids,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
        )

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def update(self, seq: Sequence, previous_len: int) -> StopMatch | None:
        """Decode seq's output into seq.text; report the first stop string that appeared."""
        text = self.decode(seq)
        stops = seq.params.stop_strings
        match = find_stop(text, stops, previous_len) if stops else None
        if match is None:
            seq.text = text
            return None
        index, stop = match
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        seq.text = text[:end]
        return StopMatch(stop, seq.text)


def find_stop(text: str, stops: tuple[str, ...], previous_len: int) -> tuple[int, str] | None:
    """Earliest stop string occurrence that ends beyond previous_len (older text was checked)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, previous_len - len(stop) + 1))
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def stream_safe_text(text: str, stops: tuple[str, ...]) -> str:
    """The part of an unfinished output that can be shown: without a trailing incomplete
    character and without a suffix that might still grow into a stop string."""
    if text.endswith("\ufffd"):
        text = text.rstrip("\ufffd")
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold] if hold else text
