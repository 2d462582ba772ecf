"""Engine output as Responses API objects: output items (message / function_call), status, usage,
and the items back as chat messages (what a `previous_response_id` continuation replays)."""
from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from app.responses_input import text_format
from app.responses_protocol import (
    FunctionCallItem, IncompleteDetails, InputTokensDetails, OutputItem, OutputMessage, OutputText, ResponseObject,
    ResponsesRequest, ResponseUsage,
)
from engine.outputs import RequestOutput
from engine.tool_calls import ParsedMessage, ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str) -> OutputMessage:
    return OutputMessage(id=new_id("msg"), content=[OutputText(text=text)], status=status)


def call_item(call: ToolCall, status: str, arguments: str | None = None) -> FunctionCallItem:
    return FunctionCallItem(id=new_id("fc"), call_id=call.id, name=call.name,
                            arguments=call.arguments if arguments is None else arguments, status=status)


def output_items(message: ParsedMessage, status: str) -> list[OutputItem]:
    """The text (one message item, also when empty and there are no calls), then one item per call."""
    items: list[OutputItem] = []
    if message.content or not message.tool_calls:
        items.append(message_item(message.content or "", status))
    items.extend(call_item(call, "completed") for call in message.tool_calls)
    return items


def status_of(finish_reason: str | None) -> tuple[str, IncompleteDetails | None]:
    """A response cut off by the token limit is "incomplete" (OpenAI: reason max_output_tokens)."""
    if finish_reason == "length":
        return "incomplete", IncompleteDetails("max_output_tokens")
    return "completed", None


def response_usage(out: RequestOutput) -> ResponseUsage:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    # Prompt tokens served from the prefix cache, as chat's usage.prompt_tokens_details.cached_tokens.
    return ResponseUsage(prompt, completion, prompt + completion, InputTokensDetails(out.num_cached_tokens))


def initial_response(req: ResponsesRequest, response_id: str, model: str, stored: bool) -> ResponseObject:
    """The response as created (in progress, no output): the request's settings echoed, as OpenAI does."""
    fmt = text_format(req.text)
    text: dict[str, Any] = {"format": (req.text or {}).get("format") if fmt else {"type": "text"}}
    return ResponseObject(
        id=response_id, created_at=int(time.time()), model=model, status="in_progress", output=[],
        instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
        parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
        store=stored, temperature=1.0 if req.temperature is None else req.temperature, text=text, tool_choice=req.tool_choice or "auto",
        tools=list(req.tools or []), top_p=1.0 if req.top_p is None else req.top_p, user=req.user,
        reasoning={"effort": (req.reasoning or {}).get("effort"), "summary": None},
    )


def finished_response(base: ResponseObject, output: list[OutputItem], finish_reason: str | None,
                      usage: ResponseUsage) -> ResponseObject:
    status, incomplete = status_of(finish_reason)
    return msgspec.structs.replace(base, status=status, incomplete_details=incomplete, output=output, usage=usage)


def items_as_messages(items: list[OutputItem]) -> list[dict[str, Any]]:
    """Output items as chat messages: the text and the calls of one turn are one assistant message."""
    text = "".join(part.text for item in items if isinstance(item, OutputMessage) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in items if isinstance(item, FunctionCallItem)]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
