"""Wire schemas of the OpenAI-compatible API, as msgspec Structs.

Requests are decoded strictly (no "8" -> 8 coercion) with `decode_request`, which turns every
msgspec error into an OpenAI-shaped 400 naming the offending field. Unknown fields are ignored
(msgspec's default), explicit `null`s mean "use the default". Responses are encoded with
`encode`; `omit_defaults` is set only where OpenAI omits absent keys (stream deltas, usage).
"""
from __future__ import annotations

import re
from types import MappingProxyType
from typing import Any, TypeVar

import msgspec

from app.errors import OpenAIError

T = TypeVar("T")


# -- requests ------------------------------------------------------------------------------
class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM: usage on every chunk


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields common to /v1/completions and /v1/chat/completions (OpenAI + vLLM extensions)."""

    model: str | None = None
    n: int | None = None
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    cache_salt: str | None = None
    # OpenAI prompt caching: a session whose latest context stays cached ("in_memory": --prompt-cache-ttl
    # seconds idle; "24h") -- engine/retention.py
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    priority: int | None = None
    user: str | None = None
    request_id: str | None = None
    # Structured outputs (vLLM extensions; app/serving.py `structured_outputs`): a dict with one of
    # json / json_object / regex / choice / grammar, or the older guided_* fields.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list of (str | token id | list of token ids); checked further in routes.
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    response_format: Any = None  # as on chat (vLLM accepts it here too)


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Tool calling (engine/tool_calls.py); legacy functions / function_call are accepted and ignored.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None  # text / json_object / json_schema -> structured outputs
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM chat extensions.
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # rendered as /v1/chat/completions renders them
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# -- responses -----------------------------------------------------------------------------
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """One entry of vLLM's `prompt_logprobs` (keyed by token id as a string)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM: when the request sets prompt_logprobs


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str  # no default: omit_defaults would drop it
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallInfo(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaToolCall(msgspec.Struct):
    """A whole tool call in one stream delta (clients concatenate `arguments` per `index`)."""

    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class ChatResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # None when the message is only tool calls
    tool_calls: list[ToolCallInfo] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM: when the request sets prompt_logprobs


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str  # no default: omit_defaults would drop it
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "prefixserve"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


# -- decoding ------------------------------------------------------------------------------
_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
# Decoders are immutable and built once at import.
_DECODERS = MappingProxyType({
    kind: msgspec.json.Decoder(kind)
    for kind in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
})
_ENCODER = msgspec.json.Encoder()


def decode_request(body: bytes, kind: type[T]) -> T:
    """Strictly decode a JSON request body; every failure is an OpenAI 400 naming the field."""
    decoder = _DECODERS.get(kind) or msgspec.json.Decoder(kind)
    if not body.strip():
        raise OpenAIError(400, "The request body is empty; expected a JSON object.")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _AT_PATH.search(message)
        param = match.group(1) or None if match else None
        if match:
            message = message[: match.start()]
        missing = _MISSING.search(message)
        if missing:  # name the missing field itself
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        where = f" (at '{param}')" if param else ""
        raise OpenAIError(400, f"Invalid request: {message}{where}.", param=param) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(
            400, f"We could not parse the JSON body of your request ({exc}). The body must be valid JSON.",
            code="invalid_json",
        ) from None


def encode(value: Any) -> bytes:
    return _ENCODER.encode(value)
