"""The Anthropic Messages API, as vLLM 0.32 serves it: POST /v1/messages (text, tool_use and tool_result
blocks, tools and tool_choice, stop_sequences, temperature / top_p / top_k, streaming with Anthropic's
event types) and POST /v1/messages/count_tokens. Requests run through the same chat pipeline as
/v1/chat/completions (template, tool-call grammar, engine); errors come back in Anthropic's shape
(app/errors.py, by path); `x-api-key` is accepted as the API key (app/auth.py).

`cache_control` breakpoints (on tools, system blocks, message blocks, or the request) retain the prompt's
prefix up to each for its ttl (5m / 1h; engine/retention.py): evicted after every unretained block.

usage, as Anthropic defines it: `cache_read_input_tokens` the prompt tokens read from the prefix cache,
`cache_creation_input_tokens` the ones newly retained at breakpoints (whole KV blocks), `input_tokens` the
rest.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, post

from app.anthropic_input import (
    AnthropicErrorResponse, CountTokensResponse, MessageResponse, MessagesRequest, MessageStreamEvent, MessageUsage,
    breakpoint_turns, chat_tool_choice, chat_tools, conversation, sampling_fields,
)
from app.auth import require_api_key
from app.errors import OpenAIError, anthropic_body, from_exception
from app.openapi import GENERATE_ERRORS, api_operation
from app.protocol import decode_request
from app.serving import ChoiceCursor, Run, check_aborted, guarded_stream, prepare_chat, sse_response
from app.state import ServerState
from engine import openai_compat
from engine.outputs import CompletionOutput, RequestOutput
from engine.tool_calls import PreparedChat, ToolCall


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _prepare(state: ServerState, req: MessagesRequest) -> PreparedChat:
    return await prepare_chat(state.tool_chat, conversation(req.system, req.messages), chat_tools(req.tools),
                              chat_tool_choice(req.tool_choice), True)


@post("/v1/messages", status_code=200, guards=[require_api_key], tags=["Anthropic"],
      operation_class=api_operation(MessagesRequest, MessageResponse, stream=MessageStreamEvent,
                                    errors=(*GENERATE_ERRORS, 529), error_body=AnthropicErrorResponse),
      summary="Create a message (Anthropic Messages API)")
async def create_message(request: Request) -> Response:
    state = _state(request)
    engine = state.require_engine()
    req = decode_request(await request.body(), MessagesRequest)
    model = state.model_name(req.model)
    if req.max_tokens is None:
        raise OpenAIError(400, "max_tokens: Field required", param="max_tokens")
    params = openai_compat.sampling_params(sampling_fields(req), max_tokens=req.max_tokens, logprobs=None,
                                           vocab_size=engine.model_info.vocab_size)
    prepared = await _prepare(state, req)
    params = prepared.apply(params)
    breakpoints = await _breakpoints(state, req, prepared)
    if breakpoints:
        params = dataclasses.replace(params, cache_breakpoints=breakpoints)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    state.admit(engine, 1)
    run = await Run.start(engine, state.metrics, [{"prompt_token_ids": prepared.prompt_token_ids}], params, message_id,
                          priority=0, cache_salt=None, max_queued=state.max_queued_requests)
    if req.stream:
        return sse_response(guarded_stream(_events(run, message_id, model, prepared), run, done=None,
                                           error=_stream_error), run)
    out, choice = await run.final_choice(request)
    parsed = prepared.parse(choice.text)
    content: list[dict[str, Any]] = []
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    content += [_tool_use(call) for call in parsed.tool_calls]
    reason, sequence = _stop_reason(choice, bool(parsed.tool_calls))
    return Response(content=msgspec.json.encode(MessageResponse(message_id, model, content, reason, sequence,
                                                                MessageUsage(**_usage(out)))),
                    media_type="application/json")


@post("/v1/messages/count_tokens", status_code=200, guards=[require_api_key], tags=["Anthropic"],
      operation_class=api_operation(MessagesRequest, CountTokensResponse, errors=(400, 401, 404, 413, 503),
                                    error_body=AnthropicErrorResponse),
      summary="Count a message's tokens (Anthropic Messages API)")
async def count_tokens(request: Request) -> Response:
    state = _state(request)
    state.require_engine()
    req = decode_request(await request.body(), MessagesRequest)
    state.model_name(req.model)
    prepared = await _prepare(state, req)
    return Response(content=msgspec.json.encode(CountTokensResponse(len(prepared.prompt_token_ids))),
                    media_type="application/json")


async def _breakpoints(state: ServerState, req: MessagesRequest, prepared: PreparedChat
                       ) -> tuple[tuple[int, float], ...]:
    """(prompt tokens, ttl seconds) of each cache_control breakpoint: where the prompt rendered with a stand-in
    message after the breakpoint's turn parts from the real one (the template's own tokens up to there)."""
    turns = breakpoint_turns(req)
    if not turns:
        return ()
    full = prepared.prompt_token_ids
    chat, tools = conversation(req.system, req.messages), chat_tools(req.tools)
    out = []
    for count, ttl in turns:
        if count >= len(chat):
            out.append((len(full), ttl))
            continue
        probe = chat[:count] + [{"role": "user", "content": "\u2063"}]
        ids = (await prepare_chat(state.tool_chat, probe, tools, None, True)).prompt_token_ids
        common = next((i for i, (a, b) in enumerate(zip(full, ids)) if a != b), min(len(full), len(ids)))
        if common:
            out.append((common, ttl))
    return tuple(out)


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": arguments}


def _stop_reason(choice: CompletionOutput, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence from the engine's finish."""
    if called:
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return ("end_turn", None) if choice.finish_reason is not None else (None, None)


def _usage(out: RequestOutput) -> dict[str, int]:
    prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens
    created = min(out.num_retained_tokens, prompt - cached)
    return {"input_tokens": prompt - cached - created, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": cached, "output_tokens": sum(len(c.token_ids) for c in out.outputs)}


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode({"type": kind, **payload}) + b"\n\n"


def _stream_error(exc: BaseException) -> bytes:
    return b"event: error\ndata: " + msgspec.json.encode(anthropic_body(from_exception(exc))) + b"\n\n"


async def _events(run: Run, message_id: str, model: str, prepared: PreparedChat) -> AsyncIterator[bytes]:
    """message_start, ping, then per content block start / deltas / stop (text as text_delta, a tool call as
    one input_json_delta), message_delta with the stop reason and the final usage (its cache numbers known once the request ends), message_stop."""
    started = False
    cursor = ChoiceCursor()
    parser = prepared.stream_parser()
    block: int = -1  # the open block's index (-1: none)
    open_kind: str | None = None
    called = False
    latest: RequestOutput | None = None
    async for _, out in run.outputs():
        latest = out
        if not started:
            usage = {**_usage(out), "output_tokens": 0}
            yield _event("message_start", {"message": {
                "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage}})
            yield _event("ping", {})
            started = True
        choice = out.outputs[0]
        check_aborted(choice)
        text, _, _ = cursor.advance(choice)
        pieces = parser.feed(text) + (parser.finish() if choice.finish_reason is not None else [])
        for piece in pieces:
            if isinstance(piece, str):
                if not piece:
                    continue
                if open_kind != "text":
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": block})
                    block, open_kind = block + 1, "text"
                    yield _event("content_block_start", {"index": block, "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"index": block, "delta": {"type": "text_delta", "text": piece}})
            else:
                if open_kind is not None:
                    yield _event("content_block_stop", {"index": block})
                block, open_kind, called = block + 1, None, True
                use = _tool_use(piece)
                yield _event("content_block_start", {"index": block, "content_block": {**use, "input": {}}})
                yield _event("content_block_delta", {"index": block, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(use["input"])}})
                yield _event("content_block_stop", {"index": block})
        if choice.finish_reason is not None:
            break
    if latest is None or latest.outputs[0].finish_reason is None:
        raise OpenAIError(503, "The request was aborted before it finished.")
    if open_kind is not None:
        yield _event("content_block_stop", {"index": block})
    choice = latest.outputs[0]
    reason, sequence = _stop_reason(choice, called)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {**_usage(latest), "output_tokens": len(choice.token_ids)}})
    yield _event("message_stop", {})


ANTHROPIC_ROUTES = [create_message, count_tokens]
