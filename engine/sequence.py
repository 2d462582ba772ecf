"""Sequence: one continuation being generated — the unit the scheduler schedules.

A request with n samples owns n sequences. Progress is one counter, `num_computed_tokens`:
tokens [0, num_computed_tokens) of `token_ids` have KV in the sequence's blocks.

    token_ids:  [ prompt ............ | outputs ....... ]
                [ computed ...................... | new ]   (new = 1 token while decoding)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int  # sample index within its request
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    arrival_order: int  # engine-wide admission counter: fcfs order and tie-breaker
    priority: int = 0
    cache_salt: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_retained_tokens: int = 0  # prompt tokens newly retained at its cache breakpoints (engine/retention.py)
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    text: str = ""  # detokenized output so far (stop strings removed)
    # n>1 sampling: the samples that fork from this sequence once its prompt is computed. They
    # are sampled from the same logits as this one, then share its blocks (copy-on-write).
    pending_forks: list["Sequence"] = field(default_factory=list)
    group_size: int = 1  # running seats this sequence will take (n samples or beam width)
    timestamps: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self, policy: str) -> tuple[int, ...]:
        """Smaller runs first and is preempted last. priority: lower value = more important (vLLM)."""
        if policy == "priority":
            return (self.priority, self.arrival_order)
        return (self.arrival_order,)
