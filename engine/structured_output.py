"""Structured outputs: grammar-constrained decoding through llguidance (vLLM's "guidance" backend).

A request's `StructuredOutputsParams` (JSON Schema, any JSON object, regex, choice, lark grammar)
becomes an llguidance grammar; each of the request's sequences gets its own matcher (a parser
state over token ids). Every step:

    matchers of the rows to sample  --grammar_mask-->  [k, ceil(V/32)] int32 bitmask (Rust, no GIL)
    sampler: raw logprobs, then logits[row, token] = -inf where the bit is 0, then choose
    engine:  accept(seq_id, token) advances the matcher; a matcher that can take nothing but EOS
             finishes its sequence with finish_reason "stop"; where the grammar then allows only one
             continuation, fast_forward() gives its tokens, appended without sampling and computed
             with the sequence's next row (grammar fast-forward: keys and punctuation of a schema)

EOS is allowed only when the grammar is complete (llguidance's mask only has EOS bits then).
Outputs end cleanly: JSON schemas get bounded numbers before they compile (engine/json_schemas.py),
each sequence keeps a token reserve that narrows its mask to a closing path when max_tokens is
about to run out (engine/grammar_budget.py), and a request may end on a repeated block
(engine/repeated_blocks.py; parallel tool calls).
Model vocab rows beyond the tokenizer's vocabulary never get a bit (the LLTokenizer is sized to the
larger of the two, and ids without bytes are never allowed).

Ownership: one `StructuredOutputManager` per Engine, used only from the engine's thread. It owns
the LLTokenizer (built lazily: ~0.4 s for a 49k vocab, paid by the first constrained request, not
by every engine), a bounded LRU of compiled grammars (pristine matchers, deep-copied per
sequence), the per-sequence matchers, and a parallel mask executor. `check_integrity` asserts that
only live sequences hold matchers.

`grammar_text` / `check_structured_outputs` are pure and thread-safe (no tokenizer): a server can
reject a malformed schema before submitting, naming its own request field.
"""
from __future__ import annotations

import json
import logging
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.grammar_budget import Closers, TokenReserve
from engine.json_schemas import ANY_JSON_OBJECT, bound_json_numbers
from engine.repeated_blocks import RepeatedBlocks
from engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger("prefixserve")

# JSON whitespace between tokens: allowed (models write `{"a": 1}` or pretty-print naturally) but
# bounded per gap. Unbounded whitespace is the classic failure of small models under JSON
# constraints: they emit newlines until max_tokens. 16 characters still fits a newline plus
# 2-space indentation seven levels deep. A schema's own "x-guidance" options override this.
JSON_COMPILE_DEFAULTS = MappingProxyType({"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"})
DEFAULT_GRAMMAR_CACHE_SIZE = 128


def grammar_text(spec: StructuredOutputsParams, *, param: str = "structured_outputs") -> str:
    """The llguidance grammar (serialized JSON text) of a constraint; malformed input ->
    InvalidRequestError(param). Does not check that the grammar compiles (see `check_structured_outputs`)."""
    import llguidance

    try:
        if spec.json is not None:
            schema = spec.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON Schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(bound_json_numbers(schema),
                                                                 defaults=dict(JSON_COMPILE_DEFAULTS))
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=dict(JSON_COMPILE_DEFAULTS))
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", list(spec.choice))
        # Lark in llguidance's syntax; GBNF (llama.cpp) is converted to it.
        return llguidance.grammar_from("grammar", spec.grammar)
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidRequestError(f"invalid {_kind(spec)} for structured output: {exc}", param=param) from None


def check_structured_outputs(spec: StructuredOutputsParams, *, param: str = "structured_outputs") -> None:
    """Raise InvalidRequestError(param) if the constraint does not compile (tokenizer-free check)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(spec, param=param))
    if error:
        raise InvalidRequestError(f"invalid {_kind(spec)} for structured output: {error}", param=param)


def _kind(spec: StructuredOutputsParams) -> str:
    if spec.json is not None:
        return "JSON schema"
    if spec.json_object:
        return "JSON object constraint"
    if spec.regex is not None:
        return "regex"
    if spec.choice is not None:
        return "choice"
    return "grammar"


@dataclass(frozen=True)
class GrammarMask:
    """The allowed tokens of the constrained rows of one sampling batch."""

    rows: torch.Tensor  # [k] long: the batch rows this mask covers (the other rows are unconstrained)
    bitmask: torch.Tensor  # [k, W] int32: token 32*w + b is allowed iff bit b of word w is set


def disallowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, W] int32 bitmask -> [k, vocab_size] bool, True where the token is NOT allowed.
    Vectorized, no loop over the vocabulary; lm_head rows past the mask's width (ids the tokenizer
    does not have) are disallowed."""
    k, words = bitmask.shape
    if sys.byteorder == "little":  # bit b of int32 word w is bit b % 8 of byte 4w + b // 8
        bits = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")  # [k, 32W] 0/1
        banned = torch.from_numpy(bits).view(torch.bool)
    else:
        banned = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(k, words * 32) == 0
    if words * 32 >= vocab_size:
        return banned[:, :vocab_size]
    return torch.cat([banned, banned.new_ones(k, vocab_size - words * 32)], dim=1)  # [k, V]


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """In place: -inf on every token the grammar does not allow, on the constrained rows only."""
    banned = disallowed_tokens(mask.bitmask, logits.shape[-1])  # [k, V]
    # Branch-free: 1e30 squared overflows to +inf, 0 stays 0, so logits - penalty is exactly -inf or
    # unchanged. (masked_fill_ branches per element: ~3x slower on the mixed masks inside strings.)
    penalty = banned.view(torch.uint8).to(logits.dtype).mul_(1e30)  # [k, V] (bool -> float directly is 6x slower)
    penalty.mul_(penalty)
    if mask.rows.numel() == logits.shape[0]:  # every row is constrained (rows are sorted and distinct)
        logits.sub_(penalty)
    else:
        logits.index_add_(0, mask.rows, penalty, alpha=-1)


def _bit(b: int) -> int:
    """Bit b of an int32 word, as the signed value torch stores."""
    return (1 << b) - (1 << 32 if b == 31 else 0)


@dataclass
class _SeqGrammar:
    matcher: Any  # llguidance.LLMatcher
    reserve: TokenReserve
    repeats: RepeatedBlocks | None


class StructuredOutputManager:
    """Compiled grammars (LRU), per-sequence matchers and batched masks. Engine thread only.

    Invariant: a sequence holds a matcher from `add` until `release`; the engine releases on
    finish and abort, keeps it through preemption (the output tokens, and so the parser state,
    survive recomputation), and n>1 samples each get their own from the start (the forks sample
    their first token from the root's logits but through their own matcher)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # logits columns (lm_head rows)
        self._eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._ll_tokenizer = None
        self._executor = None
        self._grammars: OrderedDict[str, object] = OrderedDict()  # grammar text -> pristine LLMatcher
        self._seqs: dict[str, _SeqGrammar] = {}  # seq_id -> its matcher, reserve and repeat check
        self._closer_ids: Closers | None = None
        self.num_compiled = 0  # cache misses, for tests and stats

    # -- requests -------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputsParams):
        """The pristine matcher of a constraint (cached by grammar text); InvalidRequestError if bad."""
        import llguidance

        text = grammar_text(spec)
        template = self._grammars.get(text)
        if template is not None:
            self._grammars.move_to_end(text)
            return template
        template = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
        if template.is_error():
            raise InvalidRequestError(
                f"invalid {_kind(spec)} for structured output: {template.get_error()}", param="structured_outputs"
            )
        self.num_compiled += 1
        self._grammars[text] = template
        if len(self._grammars) > self.cache_size:
            self._grammars.popitem(last=False)
        return template

    def add(self, seq_ids: Iterable[str], template, *, max_tokens: int | None = None,
            stop_on_repeated_block: tuple[str, str] | None = None) -> None:
        """Give each sequence its own matcher, a token reserve of `max_tokens` (engine/grammar_budget.py)
        and, with markers, a repeated-block check (engine/repeated_blocks.py)."""
        for seq_id in seq_ids:
            assert seq_id not in self._seqs, f"{seq_id} already holds a matcher"
            repeats = RepeatedBlocks(stop_on_repeated_block) if stop_on_repeated_block else None
            self._seqs[seq_id] = _SeqGrammar(template.deep_copy(), TokenReserve(max_tokens), repeats)

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    def accept(self, seq_id: str, token: int) -> bool:
        """Advance `seq_id`'s matcher by its sampled token. True when the sequence must finish now:
        the grammar is complete and can accept nothing else, the token completed a repeated block, or
        (never under the mask) the grammar broke."""
        state = self._seqs.get(seq_id)
        if state is None:
            return False
        matcher = state.matcher
        if not matcher.consume_token(token):
            # Only reachable if a token outside the mask was chosen; finish rather than emit garbage.
            logger.warning("structured output of %s rejected token %d: %s", seq_id, token, matcher.get_error())
            return True
        state.reserve.consumed(token, matcher.is_accepting())
        if state.repeats is not None and state.repeats.repeated(self._tokenizer().decode_bytes([token]),
                                                                matcher.is_accepting()):
            return True
        return matcher.is_stopped()

    def fast_forward(self, seq_id: str, limit: int) -> list[int]:
        """The tokens the grammar allows as the only continuation now (llguidance's fast-forward tokens, in
        its canonical tokenization), at most ``limit``; not consumed (``accept`` each). None while the token
        reserve walks its closing path (the same text, but in the walk's own tokens). Forced text is what any
        closing path takes too, so forcing it never costs the reserve its way out."""
        state = self._seqs.get(seq_id)
        if state is None or limit <= 0 or state.reserve.closing or state.matcher.is_stopped():
            return []
        return list(state.matcher.compute_ff_tokens()[:limit])

    # -- the mask -------------------------------------------------------------------------
    def valid_drafts(self, seq_id: str, drafts: Sequence[int]) -> int:
        """How many of ``drafts`` the sequence's grammar accepts from its state now (speculative decoding
        verifies only those); 0 while its token reserve may have to steer it to a close."""
        state = self._seqs.get(seq_id)
        if state is None:
            return len(drafts)
        room = state.reserve.tokens_before_closing()
        if room is not None and room <= len(drafts) + 1:  # the drafts and the sample after them
            return 0
        return state.matcher.validate_tokens(list(drafts))

    def grammar_mask(self, seq_ids: Sequence[str | None],
                     drafted: Sequence[Sequence[int]] | None = None) -> GrammarMask | None:
        """Masks for the rows whose sequence holds a matcher (None entries and others: unconstrained).
        A row whose token reserve is closing gets exactly its next closing token. ``drafted`` (speculative
        decoding): per row, draft tokens to take first -- its mask is the grammar's after them (then rolled
        back: drafts are not the sequence's tokens until they are verified)."""
        rows = [i for i, seq_id in enumerate(seq_ids) if seq_id is not None and seq_id in self._seqs]
        if not rows:
            return None
        words = (self._tokenizer().vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)  # [k, W]
        matchers = []
        for k, row in enumerate(rows):
            state = self._seqs[seq_ids[row]]
            ahead = list(drafted[row]) if drafted is not None else []
            if ahead:  # one at a time: the matcher is advanced over the drafts, then put back
                if not state.matcher.consume_tokens(ahead):
                    raise RuntimeError(f"{seq_ids[row]}: drafts the grammar had validated were refused")
                state.matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), words * 4)
                state.matcher.rollback(len(ahead))
                continue
            forced = state.reserve.forced_token(state.matcher, self._closers())
            if forced is None:
                matchers.append((state.matcher, k))
            else:
                bitmask[k] = 0
                bitmask[k, forced // 32] = _bit(forced % 32)
        if len(matchers) == 1:
            matcher, k = matchers[0]
            matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), words * 4)
        elif matchers:  # several rows: computed in parallel by llguidance's thread pool (the GIL is released)
            self._parallel().unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
        return GrammarMask(torch.tensor(rows, dtype=torch.long), bitmask)

    # -- checks ---------------------------------------------------------------------------
    def check_integrity(self, live_seq_ids: set[str]) -> None:
        stale = set(self._seqs) - live_seq_ids
        assert not stale, f"finished sequences still hold matchers: {sorted(stale)}"
        assert len(self._grammars) <= self.cache_size

    # -- lazily built parts ---------------------------------------------------------------
    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            eos = self._eos_token_ids or self._hf_tokenizer.eos_token_id
            n_vocab = max(self.vocab_size, len(self._hf_tokenizer))
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
            except ValueError as exc:  # e.g. a slow (Python) tokenizer: llguidance needs a fast one
                raise InvalidRequestError(f"this model's tokenizer does not support structured outputs: {exc}",
                                          param="structured_outputs") from None
        return self._ll_tokenizer

    def _closers(self) -> Closers:
        if self._closer_ids is None:
            eos = self._eos_token_ids[0] if self._eos_token_ids else self._hf_tokenizer.eos_token_id
            self._closer_ids = Closers(self._tokenizer(), eos)
        return self._closer_ids

    def _parallel(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor
