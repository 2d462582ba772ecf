"""Drafter: each decoding sequence's draft tokens for the next step, and what it learns from their
verification.

    draft_step(seqs, budget) -> {seq_id: drafts}   (the scheduler asks once per step; plain data)
    observe(seq_id, num_drafted, num_accepted)        after the step's verification
    finished(seq)                                     a finished request's tokens join the shared index

A sequence drafts only where nothing makes its next token depend on the drafts' own choices (no
penalties, no min_tokens still to reach: their logits processors read the tokens before each position)
and nothing asks for one token a step (beam search). Under a grammar (structured outputs, tool calls) the
drafts are cut to what the grammar accepts, and each verified position is masked by the grammar's state
after the drafts before it. A sequence's drafts pause, for twice as long each time, while they are
mostly rejected; the step verifies only the drafts its measured cost says pay (engine/speculative/cost.py).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.cost import StepCost, worth_drafting
from engine.speculative.index import Match, SequenceIndex, SharedIndex

SUFFIX_KEY_LEN = 2  # tokens of the shortest suffix looked up (shorter ones propose near-random drafts)
PRIOR_ACCEPTANCE = 0.5  # a new sequence's per-token acceptance before it has been measured
LOW_ACCEPTANCE = 0.2
MAX_PAUSE = 64  # steps


@dataclass
class _Acceptance:
    rate: float = PRIOR_ACCEPTANCE  # running per-token acceptance (exponentially weighted)
    pause: int = 0  # steps left without drafts
    next_pause: int = 2
    # A draft the step did not verify (its cost said no): its first token, compared with the token the
    # sequence then got, still measures the acceptance (else a low estimate would never be revised).
    shadow: tuple[int, int] | None = None  # (position, draft token)

    def learn(self, accepted: float) -> None:
        self.rate = 0.7 * self.rate + 0.3 * accepted

    def expected(self, length: int) -> float:
        """Tokens a draft of ``length`` is expected to add: each position is reached only if every earlier
        one was accepted."""
        a = self.rate
        return sum(a ** (i + 1) for i in range(length))


class Drafter:
    def __init__(self, config: SpeculativeConfig, cost: StepCost, max_model_len: int = 1 << 30,
                 grammar_check: Callable[[str, tuple[int, ...]], int] | None = None) -> None:
        self.config, self.cost, self.max_model_len = config, cost, max_model_len
        self.grammar_check = grammar_check  # (seq_id, drafts) -> how many the sequence's grammar accepts
        key_len = config.prompt_lookup_min if config.method == "ngram" else SUFFIX_KEY_LEN
        self.key_len = key_len
        self.own: dict[str, SequenceIndex] = {}
        self.shared = SharedIndex(key_len, config.suffix_decoding_max_cached_requests) \
            if config.method == "suffix" else None
        self.acceptance: dict[str, _Acceptance] = {}
        self.counters = SpecCounters(config.num_speculative_tokens)

    # -- proposing ------------------------------------------------------------------------
    def draft_step(self, seqs: list[Sequence], budget: int) -> dict[str, tuple[int, ...]]:
        """Drafts for decoding sequences (one new token each), within ``budget`` extra tokens, kept only
        where verifying them raises the step's output tokens per second."""
        offers = [(seq, drafts) for seq in seqs if (drafts := self._propose(seq))]
        if not offers:
            return {}
        gains = [(len(d), self.acceptance[seq.seq_id].expected(len(d))) for seq, d in offers]
        taken = set(worth_drafting(self.cost, len(seqs), float(len(seqs)), gains))
        out, used = {}, 0
        for i, (seq, drafts) in enumerate(offers):
            drafts = drafts[: max(0, budget - used)] if i in taken else ()
            if drafts:
                out[seq.seq_id] = drafts
                used += len(drafts)
            else:
                self.acceptance[seq.seq_id].shadow = (seq.num_tokens, offers[i][1][0])
        return out

    def _propose(self, seq: Sequence) -> tuple[int, ...]:
        p = seq.params
        if (p.use_beam_search or p.needs_penalties or seq.num_output_tokens < p.min_tokens
                or seq.num_computed_tokens != seq.num_tokens - 1
                or (p.structured_outputs is not None and self.grammar_check is None)):
            return ()
        state = self.acceptance.setdefault(seq.seq_id, _Acceptance())
        if state.shadow is not None and seq.num_tokens > state.shadow[0]:
            position, token = state.shadow
            state.learn(float(seq.token_ids[position] == token))
            state.shadow = None
        if state.pause:
            state.pause -= 1
            return ()
        # The bonus token after the drafts is an output too: never past max_tokens or the context.
        room = min(self.config.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)
        if room <= 0:
            return ()
        index = self.own.get(seq.seq_id)
        if index is None:
            index = self.own[seq.seq_id] = SequenceIndex(self.key_len)
        if self.config.method == "ngram":
            drafts = _ngram_draft(index.candidates(seq.token_ids, self.config.prompt_lookup_max), room)
        else:
            cfg = self.config
            depth = cfg.suffix_decoding_max_tree_depth
            matches = index.candidates(seq.token_ids, depth)
            matches += self.shared.candidates(seq.cache_salt, seq.token_ids, depth)
            drafts = _suffix_draft(matches, room, cfg.suffix_decoding_max_spec_factor,
                                   cfg.suffix_decoding_min_token_prob)
        if drafts and p.structured_outputs is not None:  # only what the grammar accepts is worth verifying
            drafts = drafts[: self.grammar_check(seq.seq_id, drafts)]
        return drafts

    # -- learning ---------------------------------------------------------------------------
    def observe(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        self.counters.record(num_drafted, num_accepted)
        state = self.acceptance.setdefault(seq_id, _Acceptance())
        # Per-token acceptance: accepted of the positions that were reached (a rejection ends the draft).
        state.learn(num_accepted / min(num_drafted, num_accepted + 1))
        if state.rate < LOW_ACCEPTANCE:
            state.pause, state.next_pause = state.next_pause, min(2 * state.next_pause, MAX_PAUSE)
            state.rate = PRIOR_ACCEPTANCE  # try again after the pause
        elif num_accepted:
            state.next_pause = 2

    def finished(self, seq: Sequence) -> None:
        self.own.pop(seq.seq_id, None)
        self.acceptance.pop(seq.seq_id, None)
        # One sample of a request is enough to learn from; beam search frees beams every step, each holding
        # the whole prompt, and never drafts: its beams would only fill the index with copies of the prompt.
        if self.shared is not None and seq.index == 0 and not seq.params.use_beam_search:
            self.shared.add(seq.cache_salt, seq.token_ids)

    def forget_requests(self) -> None:
        """Forget the finished requests drafts are taken from (with the prefix cache's reset)."""
        if self.shared is not None:
            cfg = self.config
            self.shared = SharedIndex(self.key_len, cfg.suffix_decoding_max_cached_requests)

    def check_integrity(self, live_seq_ids: set[str]) -> None:
        assert set(self.own) <= live_seq_ids and set(self.acceptance) <= live_seq_ids, "state of a gone sequence"
        if self.shared is not None:
            self.shared.check_integrity()


def _ngram_draft(matches: list[Match], room: int) -> tuple[int, ...]:
    """vLLM's prompt lookup: the continuation after the longest earlier occurrence (the newest of equals)."""
    if not matches:
        return ()
    best = max(matches, key=lambda m: (m.length, m.end))
    return tuple(best.tokens[best.end:best.end + room])


def _suffix_draft(matches: list[Match], room: int, spec_factor: float, min_prob: float) -> tuple[int, ...]:
    """Follow the continuations of the longest matches token by token: the most frequent next token while
    at least ``min_prob`` of the remaining matches agree, up to ``spec_factor`` x the matched length."""
    if not matches:
        return ()
    longest = max(m.length for m in matches)
    alive = [m for m in matches if m.length == longest]
    limit = min(room, int(spec_factor * longest))
    draft: list[int] = []
    while len(draft) < limit:
        i = len(draft)
        nexts = Counter(m.tokens[m.end + i] for m in alive if m.end + i < len(m.tokens))
        if not nexts:
            break
        token, count = nexts.most_common(1)[0]
        if count / len(alive) < min_prob:
            break
        draft.append(token)
        alive = [m for m in alive if m.end + i < len(m.tokens) and m.tokens[m.end + i] == token]
    return tuple(draft)


class SpecCounters:
    """vLLM's spec-decode metrics: drafts verified, their tokens, the accepted ones, and accepted per position."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def snapshot(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}
