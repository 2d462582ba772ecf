"""What the chat model hands its backends, and what they hand back.

Both backends (the in-process engine and the remote server) take the same `CallOptions` and produce
the same results, so ChatPrefixServe turns them into LangChain messages in one place:

    complete(messages, options) -> Completion            (n choices, usage, model name)
    stream(messages, options)   -> Delta ... Delta StreamEnd   (n == 1; StreamEnd exactly once, last)

`messages` are OpenAI chat message dicts (content already flattened to text).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROVIDER = "prefixserve"


@dataclass(frozen=True)
class CallOptions:
    """One call's settings: the model's fields with the call's overrides applied.

    `sampling` holds OpenAI-named sampling fields that were set (temperature, top_p, max_tokens, seed,
    n, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty); unset ones are absent, so
    each backend applies its own defaults. `extra` holds any other keyword: request-body fields for the
    server, SamplingParams fields in-process.
    """

    model: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: list[str] | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    cache_salt: str | None = None
    timeout: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    cache_creation_tokens: int = 0  # prompt tokens newly retained (prompt_cache_key; in-process)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: list[dict[str, Any]] | None = None  # OpenAI's logprobs.content entries


@dataclass(frozen=True)
class Completion:
    model: str
    choices: list[Choice]
    usage: Usage
    id: str | None = None


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # which call of the message this piece belongs to
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Delta:
    text: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class StreamEnd:
    model: str
    usage: Usage
    finish_reason: str | None
    id: str | None = None
