"""A conversation with tools, assistant tool calls and tool results rendered through a chat template."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


from engine.errors import InvalidRequestError
from engine.tool_calls.request import CALL_CLOSE, CALL_OPEN, FunctionTool

# -- rendering -------------------------------------------------------------------------------
def message_text(content: Any, param: str = "messages") -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, Mapping) else None
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in ("text", "input_text") or not isinstance(text, str):
                raise InvalidRequestError(f"Content parts of type {kind!r} are not supported; only text parts are.",
                                          param=f"{param}.content[{j}]")
            texts.append(text)
        return "\n".join(texts)
    raise InvalidRequestError("content must be a string, null or a list of text parts.", param=f"{param}.content")


def _function_of(call: Any, param: str) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidRequestError('Each tool call must be {"id", "type": "function", "function": {"name", '
                                  '"arguments"}}.', param=param)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # kept as text: a client may replay whatever a model wrote
    return function["name"], arguments


def tools_system_prompt(tools: Sequence[FunctionTool]) -> str:
    """The system-prompt section that teaches a template without tool support the call format."""
    signatures = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You can call functions to help with the user's request. Their signatures, as JSON, are:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments between <tool_call> and "
        "</tool_call> tags, one block per call:\n"
        f"{CALL_OPEN}\n"
        '{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n'
        f"{CALL_CLOSE}\n"
        "If no function is needed, answer in plain text."
    )


def render_call_block(name: str, arguments: Any) -> str:
    """One call written exactly as the grammar makes the model write it."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def merge_same_role(conversation: list[dict]) -> list[dict]:
    """Consecutive messages of one role (without tool calls) joined, for templates that insist on
    alternating roles."""
    merged: list[dict] = []
    for entry in conversation:
        if merged and merged[-1]["role"] == entry["role"] and not entry.get("tool_calls") \
                and not merged[-1].get("tool_calls"):
            joined = (merged[-1].get("content") or "") + "\n\n" + (entry.get("content") or "")
            merged[-1] = {**merged[-1], "content": joined}
        else:
            merged.append(dict(entry))
    return merged


def apply_chat_template(tokenizer, conversation: list[dict], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template_kwargs: Mapping | None = None,
                        tools: list[dict] | None = None) -> list[int]:
    """The template applied to `conversation`, as token ids without extra special tokens (the template has
    them). A template that rejects consecutive same-role messages gets them merged."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("This model has no chat template; use /v1/completions.", param="messages")
    if not conversation:
        raise InvalidRequestError("messages must contain at least one message.", param="messages")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("tokenize", "conversation", "messages", "tools"):
        kwargs.pop(reserved, None)
    if tools:
        kwargs["tools"] = tools
    if continue_final_message:
        if conversation[-1]["role"] != "assistant":
            raise InvalidRequestError("continue_final_message needs a final assistant message.", param="messages")
        kwargs["continue_final_message"] = True
        add_generation_prompt = False
    error: Exception | None = None
    for attempt in (conversation, merge_same_role(conversation)):
        try:
            text = tokenizer.apply_chat_template(attempt, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **kwargs)
            return tokenizer(text, add_special_tokens=False).input_ids
        except Exception as exc:  # jinja TemplateError, TypeError, ValueError from the template
            error = exc
    raise InvalidRequestError(f"The chat template could not render these messages: {error}", param="messages")
