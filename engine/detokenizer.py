"""Output text and stop-string handling for one sequence at a time.

Text grows incrementally: each sequence has a ``tokenizers.decoders.DecodeStream`` (Rust; it holds back
a partial UTF-8 character until the token that completes it), fed its newest token, so a step costs
the same at the 1,000th token as at the first. Where a character is still split at the end of the output,
the token holding its first bytes is held back (a full decode shows U+FFFD there; streaming showed
neither). Re-decoding the whole output each step, as this did
before, cost 153 us a token at 400 tokens on a 2-core AMD EPYC (Zen 4) and was 70% of a 64-sequence
decode step's host time there. A tokenizer without a fast backend, or one that cleans up spaces
after decoding (transformers' ``clean_up_tokenization_spaces``, which a stream cannot apply), keeps
the full decode. Only the newest region is searched for stop strings.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: full decodes
    DecodeStream = None


@dataclass
class _Stream:
    """A sequence's decode stream: ``fed`` output tokens went in (the last was ``last``), giving ``text``."""

    stream: object
    skip_special_tokens: bool
    fed: int = 0
    last: int = -1
    text: str = ""


@dataclass(frozen=True)
class StopMatch:
    stop: str
    text: str  # the output text, cut at (or after, with include_stop_str_in_output) the stop string


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = _stream_backend(tokenizer)  # a tokenizers.Tokenizer, or None: full decodes
        self._streams: dict[str, _Stream] = {}  # seq_id -> its stream, until release(seq_id)

    def decode(self, seq: Sequence) -> str:
        p = seq.params
        return self.tokenizer.decode(
            seq.output_token_ids,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
        )

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def text(self, seq: Sequence) -> str:
        """The whole output's text, as ``decode(seq)`` gives it, from the newest token alone where it can."""
        if self._backend is None:
            return self.decode(seq)
        out, skip = seq.output_token_ids, seq.params.skip_special_tokens
        state = self._streams.get(seq.seq_id)
        fresh = state is None or state.skip_special_tokens != skip or not (
            len(out) in (state.fed, state.fed + 1) and (state.fed == 0 or out[state.fed - 1] == state.last))
        if fresh:  # a new sequence, a fork of another (n > 1, beams), or changed params: from the start
            state = self._streams[seq.seq_id] = _Stream(DecodeStream(skip_special_tokens=skip), skip)
        for token in out[state.fed:]:
            chunk = state.stream.step(self._backend, token)
            if chunk:
                state.text += chunk
            state.fed, state.last = state.fed + 1, token
        return state.text

    def release(self, seq_id: str) -> None:
        """The sequence finished: its stream goes."""
        self._streams.pop(seq_id, None)

    def update(self, seq: Sequence, previous_len: int) -> StopMatch | None:
        """Decode seq's output into seq.text; report the first stop string that appeared."""
        text = self.text(seq)
        stops = seq.params.stop_strings
        match = find_stop(text, stops, previous_len) if stops else None
        if match is None:
            seq.text = text
            return None
        index, stop = match
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        seq.text = text[:end]
        return StopMatch(stop, seq.text)


def _stream_backend(tokenizer):
    """The Rust tokenizer a DecodeStream steps through, where streaming gives the full decode's text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or backend is None:
        return None
    # transformers cleans up only where asked and, since 5.x, never for a BPE model unless forced
    cleans = getattr(tokenizer, "clean_up_tokenization_spaces", False) and (
        type(backend.model).__name__ != "BPE"
        or getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    return None if cleans else backend


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
