"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A response is a chat completion underneath: the input (plus `instructions` and, with
`previous_response_id`, the stored conversation) becomes chat messages (app/responses_input.py),
rendered and constrained by the engine's ToolChat exactly as /v1/chat/completions does, sampled with
engine/openai_compat.py's mapping, and the generated text parsed back into message and function_call
items (app/responses_output.py; streamed: app/responses_stream.py). Stored responses live in a
bounded per-process LRU (app/responses_store.py).
"""
from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete, get, post

from app.auth import require_api_key
from app.errors import OpenAIError
from app.openapi import GENERATE_ERRORS, MODEL_ERRORS, api_operation
from app.protocol import decode_request
from app.responses_input import (
    chat_tool_choice, chat_tools, check_supported, in_responses_terms, input_messages, sampling_fields,
    with_instructions,
)
from app.responses_output import (
    finished_response, initial_response, items_as_messages, new_id, output_items, response_usage, status_of,
)
from app.responses_protocol import DeletedResponse, ResponseObject, ResponsesRequest, ResponseStreamEvent
from app.responses_store import ResponseStore
from app.responses_stream import EventWriter, response_events
from app.serving import (
    Run, finish_reason, guarded_stream, json_response, prepare_chat, sse_response,
)
from app.state import ServerState
from engine import openai_compat


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _not_found(response_id: str, param: str | None = None) -> OpenAIError:
    # vLLM answers 404 here too; the store is per process, so say what "not found" can mean.
    return OpenAIError(404, f"Response with id '{response_id}' not found (responses are kept in this server "
                       "process's memory, up to --max-stored-responses).", param=param, code="response_not_found")


def _history(store: ResponseStore, previous_id: str | None) -> tuple[dict[str, Any], ...]:
    if previous_id is None:
        return ()
    entry = store.get(previous_id)
    if entry is None:
        raise _not_found(previous_id, "previous_response_id")
    return entry.messages


@post("/v1/responses", status_code=200, guards=[require_api_key], tags=["OpenAI"],
      operation_class=api_operation(ResponsesRequest, ResponseObject, stream=ResponseStreamEvent,
                                    errors=GENERATE_ERRORS), summary="Create a model response")
async def create_response(request: Request) -> Response:
    state = _state(request)
    engine = state.require_engine()
    req = decode_request(await request.body(), ResponsesRequest)
    model = state.model_name(req.model)
    check_supported(req)
    turns = [*_history(state.responses, req.previous_response_id), *input_messages(req.input)]
    messages = with_instructions(req.instructions, turns)
    with in_responses_terms():
        params = openai_compat.sampling_params(sampling_fields(req), max_tokens=req.max_output_tokens,
                                               logprobs=None, vocab_size=engine.model_info.vocab_size)
        prepared = await prepare_chat(state.tool_chat, messages, chat_tools(req.tools),
                                      chat_tool_choice(req.tool_choice), req.parallel_tool_calls)
        params = prepared.apply(params)
    stored = req.store is not False and state.responses.capacity > 0
    response_id = new_id("resp")
    base = initial_response(req, response_id, model, stored)

    def finished(response: ResponseObject) -> None:
        if stored:
            state.responses.put(response, [*turns, *items_as_messages(response.output)])

    state.admit(engine, 1)
    run = await Run.start(engine, state.metrics, [{"prompt_token_ids": prepared.prompt_token_ids}], params,
                          req.request_id or response_id, priority=req.priority or 0, cache_salt=req.cache_salt,
                          max_queued=state.max_queued_requests)
    if req.stream:
        event = EventWriter()
        body = guarded_stream(response_events(run, base, prepared, event, finished), run, done=None,
                              error=event.error)
        return sse_response(body, run)
    out, choice = await run.final_choice(request)
    reason = finish_reason(choice)
    status, _ = status_of(reason)
    response = finished_response(base, output_items(prepared.parse(choice.text), status), reason,
                                 response_usage(out))
    finished(response)
    return json_response(response)


@get("/v1/responses/{response_id:str}", guards=[require_api_key], tags=["OpenAI"],
     operation_class=api_operation(response=ResponseObject, errors=MODEL_ERRORS),
     summary="Retrieve a stored model response")
async def retrieve_response(request: Request, response_id: str) -> Response:
    entry = _state(request).responses.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return json_response(entry.response)


@delete("/v1/responses/{response_id:str}", status_code=200, guards=[require_api_key], tags=["OpenAI"],
        operation_class=api_operation(response=DeletedResponse, errors=MODEL_ERRORS),
        summary="Delete a stored model response")
async def delete_response(request: Request, response_id: str) -> Response:
    if not _state(request).responses.delete(response_id):
        raise _not_found(response_id)
    return json_response(DeletedResponse(response_id))


RESPONSES_ROUTES = [create_response, retrieve_response, delete_response]
