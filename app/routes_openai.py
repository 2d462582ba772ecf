"""The OpenAI endpoints: /v1/completions, /v1/chat/completions, /v1/models."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from litestar import Request, Response, get, post

from app.errors import OpenAIError
from app.auth import require_api_key
from app.openapi import (
    CHAT_EXAMPLES, COMPLETION_EXAMPLES, GENERATE_ERRORS, LIST_ERRORS, MODEL_ERRORS, api_operation,
)
from app.protocol import (
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse, ChatResponseMessage,
    ChatStreamChoice, CompletionRequest, CompletionResponse, CompletionStreamChoice, CompletionStreamResponse,
    DeltaMessage, DeltaToolCall, FunctionCall, ModelCard, ModelList, ToolCallInfo, Usage, decode_request,
)
from app.completion_choices import CompletionChoices, prompt_logprob_structs
from app.serving import (
    ChoiceCursor, Run, chat_conversation, chat_logprobs, check_aborted, completion_prompts,
    completion_sampling_params, finish_reason, guarded_stream, json_response, prepare_chat, sampling_params, sse,
    sse_response, usage,
)
from app.state import ServerState
from engine import openai_compat
from engine.outputs import RequestOutput
from engine.tool_calls import PreparedChat, ToolCall

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _stream_flags(req) -> tuple[bool, bool]:
    options = req.stream_options
    if options is None:
        return False, False
    return bool(options.include_usage), bool(options.continuous_usage_stats)


# -- /v1/completions -----------------------------------------------------------------------
@post("/v1/completions", status_code=200, guards=[require_api_key], tags=["OpenAI"],
      operation_class=api_operation(CompletionRequest, CompletionResponse, stream=CompletionStreamResponse,
                                    errors=GENERATE_ERRORS, examples=COMPLETION_EXAMPLES),
      summary="Create a completion")
async def create_completion(request: Request) -> Response:
    state = _state(request)
    engine = state.require_engine()
    req = decode_request(await request.body(), CompletionRequest)
    model = state.model_name(req.model)
    if req.suffix:
        raise OpenAIError(400, "suffix is not supported.", param="suffix")
    prompts = completion_prompts(req.prompt)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = completion_sampling_params(req, max_tokens=max_tokens, vocab_size=engine.model_info.vocab_size)
    request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    state.admit(engine, len(prompts))
    run = await Run.start(engine, state.metrics, prompts, params, request_id, priority=req.priority or 0,
                          cache_salt=req.cache_salt, max_queued=state.max_queued_requests)
    created = int(time.time())

    def prompt_text(out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else engine.detokenize(out.prompt_token_ids)

    shapes = CompletionChoices(echo=bool(req.echo), generate=max_tokens > 0, logprobs=req.logprobs,
                               prompt_logprobs=req.prompt_logprobs, decode=engine.decode_token,
                               prompt_text=prompt_text)
    if req.stream:
        include_usage, continuous = _stream_flags(req)
        events = _completion_events(run, request_id, created, model, params.n, shapes, include_usage, continuous)
        return sse_response(guarded_stream(events, run), run)
    try:
        finals = [shapes.visible(out) for out in await run.final_outputs(request)]
    finally:
        await run.close()
    choices = []
    for i, out in enumerate(finals):
        for c in out.outputs:
            check_aborted(c)
            choices.append(shapes.choice(i * params.n + c.index, out, c))
    return json_response(CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                    usage=usage(finals)))


async def _completion_events(run: Run, request_id: str, created: int, model: str, n: int, shapes: CompletionChoices,
                             include_usage: bool, continuous: bool) -> AsyncIterator[bytes]:
    cursors: dict[tuple[int, int], ChoiceCursor] = {}
    latest: dict[int, RequestOutput] = {}
    async for i, out in run.outputs():
        out = latest[i] = shapes.visible(out)
        for c in out.outputs:
            cursor = cursors.setdefault((i, c.index), ChoiceCursor())
            if cursor.done:
                continue
            check_aborted(c)
            text, lp = shapes.delta(out, c, cursor)
            reason = finish_reason(c)
            if not text and reason is None and lp is None:
                continue
            cursor.done = reason is not None
            yield sse(CompletionStreamResponse(
                id=request_id, object="text_completion", created=created, model=model,
                choices=[CompletionStreamChoice(i * n + c.index, text, lp, reason, c.stop_reason if reason else None)],
                usage=usage(list(latest.values())) if continuous else None,
            ))
    if len(cursors) < len(run.streams) * n or not all(c.done for c in cursors.values()):
        raise OpenAIError(503, "The request was aborted before it finished.")
    if include_usage:
        yield sse(CompletionStreamResponse(id=request_id, object="text_completion", created=created, model=model,
                                           choices=[], usage=usage(list(latest.values()))))


# -- /v1/chat/completions ------------------------------------------------------------------
@post("/v1/chat/completions", status_code=200, guards=[require_api_key], tags=["OpenAI"],
      operation_class=api_operation(ChatCompletionRequest, ChatCompletionResponse,
                                    stream=ChatCompletionStreamResponse, errors=GENERATE_ERRORS,
                                    examples=CHAT_EXAMPLES),
      summary="Create a chat completion")
async def create_chat_completion(request: Request) -> Response:
    state = _state(request)
    engine = state.require_engine()
    req = decode_request(await request.body(), ChatCompletionRequest)
    model = state.model_name(req.model)
    conversation = chat_conversation(req.messages)
    top = req.top_logprobs
    if top is not None and top > 0 and not req.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise OpenAIError(400, f"top_logprobs must be in [0, 20], got {top}.", param="top_logprobs")
    k = (top or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens=max_tokens, logprobs=k, vocab_size=engine.model_info.vocab_size)
    # The template with tools, tool calls and tool results, plus the tool-call grammar (engine/tool_calls.py).
    prepared = await prepare_chat(
        state.tool_chat, conversation, req.tools, req.tool_choice, req.parallel_tool_calls,
        add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
        continue_final_message=bool(req.continue_final_message), chat_template_kwargs=req.chat_template_kwargs,
    )
    params = prepared.apply(params)
    prompt_ids = prepared.prompt_token_ids
    request_id = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    state.admit(engine, 1)
    run = await Run.start(engine, state.metrics, [{"prompt_token_ids": prompt_ids}], params, request_id,
                          priority=req.priority or 0, cache_salt=req.cache_salt, max_queued=state.max_queued_requests)
    created = int(time.time())
    decode = engine.decode_token
    if req.stream:
        include_usage, continuous = _stream_flags(req)
        events = _chat_events(run, request_id, created, model, params.n, k, include_usage, continuous, decode,
                              prepared)
        return sse_response(guarded_stream(events, run), run)
    try:
        finals = await run.final_outputs(request)
    finally:
        await run.close()
    out = finals[0]
    choices = []
    for c in out.outputs:
        check_aborted(c)
        lp = chat_logprobs(c.token_ids, c.logprobs or [], k, decode) if k is not None else None
        message = prepared.parse(c.text)
        calls = [ToolCallInfo(t.id, FunctionCall(t.name, t.arguments)) for t in message.tool_calls] or None
        choices.append(ChatChoice(c.index, ChatResponseMessage("assistant", message.content, calls), lp,
                                  message.finish_reason(finish_reason(c)), c.stop_reason))
    prompt_lp = None
    if req.prompt_logprobs is not None:
        prompt_lp = prompt_logprob_structs(
            openai_compat.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, req.prompt_logprobs))
    return json_response(ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                        usage=usage(finals), prompt_logprobs=prompt_lp))


def _chat_chunk(request_id: str, created: int, model: str, choices: list[ChatStreamChoice],
                usage_: Usage | None = None) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk", created=created, model=model,
                                        choices=choices, usage=usage_)


async def _chat_events(run: Run, request_id: str, created: int, model: str, n: int, k: int | None,
                       include_usage: bool, continuous: bool, decode, prepared: PreparedChat) -> AsyncIterator[bytes]:
    for index in range(n):  # OpenAI: the first delta of every choice carries the role
        yield sse(_chat_chunk(request_id, created, model, [ChatStreamChoice(index, DeltaMessage("assistant", ""))]))
    cursors = [ChoiceCursor() for _ in range(n)]
    parsers = [prepared.stream_parser() for _ in range(n)]  # text -> content pieces and whole tool calls
    num_calls = [0] * n
    latest: RequestOutput | None = None
    async for _, out in run.outputs():
        latest = out
        for c in out.outputs:
            cursor = cursors[c.index]
            if cursor.done:
                continue
            check_aborted(c)
            text, start, end = cursor.advance(c)
            lp = None
            if k is not None and end > start and c.logprobs is not None:
                lp = chat_logprobs(c.token_ids[start:end], c.logprobs[start:end], k, decode)
            reason = finish_reason(c)
            pieces = parsers[c.index].feed(text) + (parsers[c.index].finish() if reason is not None else [])
            content = "".join(p for p in pieces if isinstance(p, str))
            calls = []
            for call in (p for p in pieces if isinstance(p, ToolCall)):
                calls.append(DeltaToolCall(num_calls[c.index], call.id, FunctionCall(call.name, call.arguments)))
                num_calls[c.index] += 1
            reason = parsers[c.index].finish_reason(reason)
            if not content and not calls and reason is None and lp is None:
                continue
            cursor.done = reason is not None
            delta = DeltaMessage(content=content or None, tool_calls=calls or None)
            yield sse(_chat_chunk(request_id, created, model, [ChatStreamChoice(c.index, delta, lp, reason)],
                                  usage([out]) if continuous else None))
    if latest is None or not all(c.done for c in cursors):
        raise OpenAIError(503, "The request was aborted before it finished.")
    if include_usage:
        yield sse(_chat_chunk(request_id, created, model, [], usage([latest])))


# -- /v1/models ----------------------------------------------------------------------------
@get("/v1/models", guards=[require_api_key], tags=["OpenAI"], summary="List models",
     operation_class=api_operation(response=ModelList, errors=LIST_ERRORS))
async def list_models(request: Request) -> Response:
    state = _state(request)
    engine = state.require_engine()
    info = engine.model_info
    cards = [ModelCard(name, state.created, info.model, info.max_model_len) for name in state.model_names]
    return json_response(ModelList(cards))


@get("/v1/models/{model_id:path}", guards=[require_api_key], tags=["OpenAI"], summary="Retrieve a model",
     operation_class=api_operation(response=ModelCard, errors=MODEL_ERRORS))
async def retrieve_model(request: Request, model_id: str) -> Response:
    state = _state(request)
    engine = state.require_engine()
    name = state.model_name(model_id.lstrip("/"))
    info = engine.model_info
    return json_response(ModelCard(name, state.created, info.model, info.max_model_len))


OPENAI_ROUTES = [create_completion, create_chat_completion, list_models, retrieve_model]
