"""SchedulerOutput: one step's decisions as plain data, all the model runner needs to execute it.

No `Sequence` crosses this line: the runner sees row order, tokens and positions, block tables,
and which rows sample into how many samples, and builds its tensors from those alone.

    rows:  [ decode rows (1 new token) ............ | prefill chunks (>1 new tokens) ...... ]
           each row: seq_id, start (= num_computed_tokens), the new tokens, block_ids,
                     samples drawn from its last position (root first, then the forks it makes),
                     or, for a row carrying draft tokens, from each of its last k + 1 positions
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from prefix_cache import KVTransfers


@dataclass(frozen=True)
class SampleSpec:
    """One sample drawn from a row's last logits: the row's own sequence, or a fork of it (n>1)."""

    seq_id: str
    params: SamplingParams
    banned_token_ids: tuple[int, ...]  # EOS / stop tokens while below min_tokens
    num_top_logprobs: int | None  # None: no logprobs wanted
    # All tokens so far and the prompt length, only for params with penalties (the common case
    # copies no history).
    history: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    output_index: int = 0  # which of the sequence's output tokens this draws (a seeded row's draw is keyed by it)


@dataclass(frozen=True)
class PromptLogprobsSpec:
    """Score prompt tokens [first_position, first_position + len(targets)) with the row's logits."""

    num_top: int
    first_position: int  # row position p's logits score prompt token p + 1
    targets: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledRow:
    seq_id: str
    start: int  # == num_computed_tokens when scheduled: position of token_ids[0]
    token_ids: tuple[int, ...]  # the new tokens [start, start + num_new_tokens)
    block_ids: tuple[int, ...]  # the sequence's block table (covers at least [0, end))
    samples: tuple[SampleSpec, ...] = ()  # empty: a prefill chunk that does not reach its last token
    prompt_logprobs: PromptLogprobsSpec | None = None
    # Speculative decoding: the last num_draft_tokens of token_ids are guesses, not the sequence's tokens
    # yet. The row samples at its last num_draft_tokens + 1 positions; the runner keeps the drafts that
    # agree with those samples and the sample after them (engine/speculative/).
    num_draft_tokens: int = 0
    # How many of token_ids (the first ones) are the prompt's: AttentionMetadata.num_prompt_tokens
    num_prompt_tokens: int = 0

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    rows: tuple[ScheduledRow, ...]  # decodes (one new token, plus any drafts) first, then prefill chunks
    copies: tuple[tuple[int, int], ...]  # (src, dst) KV block copies to run before the forward
    preempted_seq_ids: tuple[str, ...]
    # Tier moves (demotions, loads, swaps) to run before the copies; see prefix_cache/tiers.py.
    transfers: KVTransfers = KVTransfers()
    finished_seq_ids: tuple[str, ...] = ()  # gone since the last step: the runner drops their state

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)

    @property
    def num_draft_tokens(self) -> int:
        return sum(r.num_draft_tokens for r in self.rows)

    @property
    def num_decode_rows(self) -> int:
        """Decoding rows (one new token, plus any drafts): they come first."""
        return sum(1 for r in self.rows if r.num_new_tokens - r.num_draft_tokens == 1)
