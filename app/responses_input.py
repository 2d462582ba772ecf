"""A Responses API request as what /v1/chat/completions already understands: chat messages, chat-shaped
tools and tool_choice, and the sampling fields engine/openai_compat.py maps (text.format becomes
`response_format`). Everything here is pure; bad input raises OpenAIError(400) naming the Responses
field (`input[2].content[0]`, `tools[1].name`, `text.format`), never the chat field it maps to.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from app.errors import OpenAIError
from app.responses_protocol import ResponsesRequest
from engine.errors import ContextLengthExceededError, InvalidRequestError

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# Reasoning items carry nothing this server's models read (summaries of another model's thinking):
# they are skipped, so a history produced elsewhere still replays.
SKIPPED_ITEMS = ("reasoning",)
REASONING_KEYS = ("effort", "summary", "generate_summary")


def _bad(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


# -- what is refused -------------------------------------------------------------------------
def check_supported(req: ResponsesRequest) -> None:
    """Refuse, with a 400 naming the field, what this server cannot do (rather than ignoring it)."""
    refused = {
        "background": "Background responses are not supported; omit background or set it to false.",
        "conversation": "Conversations objects are not supported; use previous_response_id or send the history "
                        "in input.",
        "prompt": "Stored prompt templates are not supported; send instructions and input instead.",
        "max_tool_calls": "max_tool_calls is not supported.",
        "top_logprobs": "Log probabilities are not supported on /v1/responses; use /v1/chat/completions.",
    }
    for name, message in refused.items():
        value = getattr(req, name)
        if value not in (None, False, 0):
            raise _bad(message, name)
    if req.truncation not in (None, "disabled"):
        raise _bad("Only truncation 'disabled' is supported: an input longer than the context is a 400.",
                   "truncation")
    reasoning = req.reasoning or {}
    extra = [k for k, v in reasoning.items() if v is not None and k not in REASONING_KEYS]
    if extra or reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
        raise _bad("Only reasoning.effort is accepted (and ignored): the served model does not reason.",
                   "reasoning")
    if "message.output_text.logprobs" in (req.include or ()):
        raise _bad("Log probabilities are not supported on /v1/responses; use /v1/chat/completions.", "include")


# -- input -> chat messages ------------------------------------------------------------------
def input_messages(value: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; items are messages (text parts only),
    `function_call` items (joined into the assistant turn before them) and `function_call_output` items
    (tool turns)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise _bad("input must be a non-empty string or a non-empty list of items.", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, param))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)}}
            if out and out[-1]["role"] == "assistant":  # text then calls, or several calls: one turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{param}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": text})
        elif kind not in SKIPPED_ITEMS:
            raise _bad(f"Input items of type {kind!r} are not supported; use message, function_call and "
                       "function_call_output items.", f"{param}.type")
    return out


def _message(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise _bad(f"Invalid role {role!r}; expected one of {list(MESSAGE_ROLES)}.", f"{param}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{param}.content")
    return {"role": role, "content": text}


def _parts_text(parts: Any, param: str) -> str:
    if not isinstance(parts, list):
        raise _bad("content must be a string or a list of input_text parts.", param)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, Mapping) else None
        if kind not in (*TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise _bad(f"Content parts of type {kind!r} are not supported; only text parts (input_text) are.",
                       f"{param}[{j}]")
        texts.append(text)
    return "\n".join(texts)


def _string(item: Mapping[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{param}.{key} must be a string.", f"{param}.{key}")
    return value


def with_instructions(instructions: str | None, turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The whole prompt: `instructions` as the system message before the turns (the previous response's
    conversation, then this input). Instructions are never carried over from a previous response, as
    on OpenAI: each request states its own."""
    return [{"role": "system", "content": instructions}, *turns] if instructions else turns


# -- tools ----------------------------------------------------------------------------------
def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools (`{type, name, description, parameters, strict}`) in chat's
    nested shape; built-in tools (web_search, file_search, mcp, ...) are a 400."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise _bad(f"Only function tools are supported; tools[{i}] is of type {kind!r}.", f"tools[{i}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    """"auto" / "none" / "required" as they are; `{"type": "function", "name"}` in chat's shape."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}; '
               f"{choice.get('type')!r} choices are not supported.", "tool_choice")


# -- sampling -------------------------------------------------------------------------------
def text_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (json_schema's fields sit one level down there)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt.get(k) for k in ("name", "schema", "strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise _bad('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", '
               '"schema", "strict"}.', "text.format")


def sampling_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The fields engine/openai_compat.sampling_params reads (one sample; no stop strings in this API)."""
    fields = {name: getattr(req, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                                    "seed", "ignore_eos", "prompt_cache_key",
                                                    "prompt_cache_retention")}
    fields["response_format"] = text_format(req.text)
    return fields


# -- errors in Responses' terms ---------------------------------------------------------------
_CHAT_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "n": None}
_TOOL_FIELD = re.compile(r"\b(tools\[\d+\])\.function\b")


def responses_param(param: str | None) -> str | None:
    """A chat-side param name as the Responses field it came from."""
    if param is None:
        return None
    if param in _CHAT_PARAMS:
        return _CHAT_PARAMS[param]
    if param.startswith("messages"):  # indices shift (instructions, history): name the field only
        return "input"
    return _TOOL_FIELD.sub(r"\1", param)


@contextlib.contextmanager
def in_responses_terms() -> Iterator[None]:
    """Re-raise the engine's InvalidRequestError (from the chat mapping) as a 400 naming the Responses field."""
    try:
        yield
    except ContextLengthExceededError:
        raise  # keeps its code (context_length_exceeded)
    except InvalidRequestError as exc:
        message = _TOOL_FIELD.sub(r"\1", str(exc)).replace("response_format", "text.format")
        raise OpenAIError(400, message, param=responses_param(exc.param)) from None
