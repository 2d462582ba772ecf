"""An Anthropic Messages API request as what /v1/chat/completions already understands: chat messages
(system text, text / tool_use / tool_result blocks), chat-shaped tools and tool_choice, and the sampling
fields engine/openai_compat.py maps. Pure; bad input raises OpenAIError(400) naming the Messages field
(`messages[2].content[0].type`), which the error handler turns into Anthropic's error shape.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from app.errors import OpenAIError


class MessagesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/messages (and /v1/messages/count_tokens, where max_tokens is not needed)."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None  # a breakpoint after the last message (breakpoint_turns)


class MessageUsage(msgspec.Struct):
    input_tokens: int  # prompt tokens not read from the prefix cache
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(msgspec.Struct):
    id: str
    model: str
    content: list[dict[str, Any]]  # {"type": "text", "text"} and {"type": "tool_use", "id", "name", "input"}
    stop_reason: str | None  # end_turn | max_tokens | stop_sequence | tool_use
    stop_sequence: str | None
    usage: MessageUsage
    type: str = "message"
    role: str = "assistant"


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class MessageStreamEvent(msgspec.Struct, kw_only=True):
    """One event of a streamed message (`event: <type>` and its JSON as `data:`): message_start, ping,
    content_block_start / _delta / _stop, message_delta, message_stop, or error."""

    type: str
    index: int | None = None
    message: dict[str, Any] | None = None
    content_block: dict[str, Any] | None = None
    delta: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class AnthropicErrorDetail(msgspec.Struct):
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...
    message: str


class AnthropicErrorResponse(msgspec.Struct):
    type: str
    error: AnthropicErrorDetail


def _bad(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def _text(content: Any, param: str, allowed: tuple[str, ...] = ("text",)) -> str:
    """A string, or the concatenated text of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content blocks.", param)
    out = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind not in allowed:
            raise _bad(f"content block type {kind!r} is not supported here; expected one of {list(allowed)}.",
                       f"{param}[{i}].type")
        out.append(str(block.get("text", "")))
    return "".join(out)


def conversation(system: str | Sequence[Mapping[str, Any]] | None, messages: Sequence[Mapping[str, Any]]
                 ) -> list[dict[str, Any]]:
    """Messages API turns as chat-template messages: tool_use blocks become an assistant's tool_calls,
    tool_result blocks become tool messages (before the user's own text of that turn)."""
    if not messages:
        raise _bad("messages: at least one message is required.", "messages")
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"messages: roles must be 'user' or 'assistant', got {role!r}.", f"{param}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad("content must be a string or a list of content blocks.", f"{param}.content")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            where = f"{param}.content[{j}]"
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                    "name": str(block.get("name", "")), "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                body = block.get("content", "")
                results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                                "content": _text(body, f"{where}.content") if body else ""})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # another model's reasoning: nothing this server's models read
            else:
                raise _bad(f"content block type {kind!r} is not supported in a {role} message.", f"{where}.type")
        out.extend(results)
        if texts or calls or not results:
            entry: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad("tools: every tool needs a name.", f"tools[{i}].name")
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"server tools ({tool.get('type')!r}) are not supported; give custom tools with "
                       "input_schema.", f"tools[{i}].type")
        out.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                                      "parameters": tool.get("input_schema") or {"type": "object"}}})
    return out


def chat_tool_choice(choice: Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    """auto / any / tool / none as the chat API's auto / required / a named function / none."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}.",
               "tool_choice")


CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}  # cache_control's ttl values (Anthropic's default: 5 minutes)
MAX_BREAKPOINTS = 4  # as Anthropic allows


def _ttl(control: Any, param: str) -> float:
    if not isinstance(control, Mapping) or control.get("type") != "ephemeral":
        raise _bad("cache_control must be {\"type\": \"ephemeral\"} with an optional ttl.", param)
    ttl = control.get("ttl", "5m")
    if ttl not in CACHE_TTLS:
        raise _bad(f"cache_control.ttl must be one of {sorted(CACHE_TTLS)}, got {ttl!r}.", f"{param}.ttl")
    return CACHE_TTLS[ttl]


def breakpoint_turns(req: MessagesRequest) -> list[tuple[int, float]]:
    """Each cache_control breakpoint as (how many chat messages of ``conversation()`` its prefix ends after,
    its TTL in seconds): one on a tool or a system block ends after the system message (the templates render
    tools there; 0 without one), one on a block of message i after that message's turn, the request's own
    after the last message. Bad cache_control, or more than 4 breakpoints, is a 400."""
    turns: list[tuple[int, float]] = []
    system_turns = 1 if req.system else 0
    for i, tool in enumerate(req.tools or ()):
        if isinstance(tool, Mapping) and tool.get("cache_control") is not None:
            turns.append((system_turns, _ttl(tool["cache_control"], f"tools[{i}].cache_control")))
    if isinstance(req.system, list):
        for j, block in enumerate(req.system):
            if isinstance(block, Mapping) and block.get("cache_control") is not None:
                turns.append((system_turns, _ttl(block["cache_control"], f"system[{j}].cache_control")))
    for i, message in enumerate(req.messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            if isinstance(block, Mapping) and block.get("cache_control") is not None:
                ttl = _ttl(block["cache_control"], f"messages[{i}].content[{j}].cache_control")
                turns.append((len(conversation(req.system, req.messages[: i + 1])), ttl))
    if req.cache_control is not None:
        turns.append((len(conversation(req.system, req.messages)), _ttl(req.cache_control, "cache_control")))
    if len(turns) > MAX_BREAKPOINTS:
        raise _bad(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {len(turns)}.",
                   "cache_control")
    return turns


def sampling_fields(req: MessagesRequest) -> dict[str, Any]:
    """The chat sampling fields engine/openai_compat.py maps."""
    fields: dict[str, Any] = {"stop": req.stop_sequences}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise _bad(f"temperature: must be in [0, 1], got {req.temperature}.", "temperature")
    return fields
