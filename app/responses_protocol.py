"""Wire schemas of `POST /v1/responses` (OpenAI's Responses API), as msgspec Structs.

The shapes follow the `openai` package's `openai.types.responses` (Response, ResponseOutputMessage,
ResponseFunctionToolCall, ResponseUsage). Input items and tools stay plain dicts here: they are
validated item by item in app/responses_input.py, which names the offending field in its 400s.
"""
from __future__ import annotations

from typing import Any

import msgspec


# -- request -------------------------------------------------------------------------------
class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None  # OpenAI's default is true
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {...}, "verbosity": ...}
    reasoning: dict[str, Any] | None = None  # only `effort` is accepted (and ignored)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    # OpenAI prompt caching (engine/retention.py): the session's latest context stays cached.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Accepted and ignored: hints for OpenAI's own infrastructure.
    service_tier: str | None = None
    safety_identifier: str | None = None
    include: list[str] | None = None
    # Refused with a 400 when set (app/responses_input.py `check_supported`).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    # vLLM's extensions, as on the other endpoints.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = None
    priority: int | None = None
    request_id: str | None = None


# -- response ------------------------------------------------------------------------------
class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


# Tagged by "type" (msgspec writes it), so the union below has a schema.
class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: str  # in_progress | completed | incomplete
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: str


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0  # no reasoning models here


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete
    output: list[OutputItem]
    object: str = "response"
    error: Any = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = msgspec.field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None = None


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


class ResponseStreamEvent(msgspec.Struct, kw_only=True):
    """One server-sent event of a streamed response, as documented in the OpenAPI spec: every event
    has a `type` (response.created, response.output_text.delta, ...) and a `sequence_number`; the
    other fields depend on the type (app/responses_stream.py writes them)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    item_id: str | None = None
    output_index: int | None = None
    content_index: int | None = None
    delta: str | None = None
