"""The operator's cache endpoints (engine/retention.py): look a prefix up, retain one now, release one.

    POST /v1/cache/lookup   {prompt | messages | prompt_token_ids, cache_salt?}       -> tokens cached per tier
                            (device, retained, host, then Redis: remote_tokens, null when Redis is off or
                            does not answer)
    POST /v1/cache/retain   {... , ttl: seconds}  compute the prefix (one forward) and retain it: warm a RAG
                            corpus or a system prompt + tools before traffic arrives
    POST /v1/cache/release  {...}                 end its retention (it is evicted in LRU order again)
    POST /v1/cache/check                          the engine's invariants (check_integrity, between steps) and
                                                  its block counts: a soak's or an operator's leak check

A prompt is tokenized as /tokenize does; `messages` are rendered by the chat template with the generation
prompt (what a chat request with those messages and `tools` sends). Retention is an eviction order, never a
pin: no request is refused because of it.
"""
from __future__ import annotations

import uuid
from typing import Any

import msgspec
from litestar import Request, Response, post

from app.auth import require_api_key
from app.errors import OpenAIError
from app.openapi import BODY_ERRORS, api_operation
from app.protocol import ChatMessage, decode_request
from app.serving import Run, chat_conversation, render_chat
from app.state import ServerState
from engine.sampling_params import RETENTION_MAX_S, SamplingParams
from engine.tool_calls import parse_tool_request


class CacheRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    tools: list[Any] | None = None  # rendered with messages, as /v1/chat/completions renders them
    cache_salt: str | None = None
    ttl: float = 300.0  # seconds (retain), Anthropic's default cache_control TTL


class CacheLookupResponse(msgspec.Struct):
    prompt_tokens: int
    device_tokens: int  # whole KV blocks of the prefix cached in the device pool
    retained_tokens: int  # of those, the retained ones
    host_tokens: int  # continuing them in the host tier
    # continuing device + host in Redis: whole blocks present there (one pipelined EXISTS, the tier's timeout);
    # null without a Redis tier or when it did not answer
    remote_tokens: int | None = None


class CacheRetainResponse(msgspec.Struct):
    prompt_tokens: int
    retained_tokens: int  # the prefix retained now (whole KV blocks)
    computed_tokens: int  # computed for it (the rest was cached)
    ttl: float


class CacheReleaseResponse(msgspec.Struct):
    released_tokens: int


class CacheCheckResponse(msgspec.Struct):
    ok: bool  # every invariant of the block pool, the tiers and the scheduler holds
    error: str | None  # the first that did not
    blocks_in_use: int  # held by requests (0 when none is in flight)
    retained_blocks: int
    free_blocks: int
    evictable_blocks: int
    num_blocks: int
    running: int
    waiting: int


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _token_ids(state: ServerState, req: CacheRequest) -> list[int]:
    given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(req, name) is not None]
    if len(given) != 1:
        raise OpenAIError(400, "Pass exactly one of prompt, messages and prompt_token_ids.", param="prompt")
    engine = state.require_engine()
    if req.messages is not None:
        ids = render_chat(state.tool_chat, chat_conversation(req.messages), add_generation_prompt=True,
                          continue_final_message=False, template_kwargs=None, tools=parse_tool_request(req.tools))
    elif req.prompt is not None:
        ids = engine.tokenize(req.prompt, add_special_tokens=True)
    else:
        ids = list(req.prompt_token_ids)
    vocab = engine.model_info.vocab_size
    if not ids or any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise OpenAIError(400, f"The prompt must be non-empty token ids in [0, {vocab}).", param="prompt")
    return ids


async def _read(request: Request) -> tuple[ServerState, CacheRequest, list[int]]:
    """The server state, the request body and its prompt's token ids (400 / 404 / 503 as the other routes)."""
    state = _state(request)
    req = decode_request(await request.body(), CacheRequest)
    state.model_name(req.model)
    return state, req, _token_ids(state, req)


def _json(body: msgspec.Struct) -> Response:
    return Response(content=msgspec.json.encode(body), media_type="application/json")


@post("/v1/cache/lookup", status_code=200, guards=[require_api_key], tags=["Cache"],
      operation_class=api_operation(CacheRequest, CacheLookupResponse, errors=BODY_ERRORS),
      summary="How much of a prompt's prefix is cached, per tier")
async def cache_lookup(request: Request) -> Response:
    state, req, ids = await _read(request)
    found = await state.require_engine().cache_lookup(ids, cache_salt=req.cache_salt)
    return _json(CacheLookupResponse(len(ids), found["device_tokens"], found["retained_tokens"], found["host_tokens"],
                                     found.get("remote_tokens")))


@post("/v1/cache/retain", status_code=200, guards=[require_api_key], tags=["Cache"],
      operation_class=api_operation(CacheRequest, CacheRetainResponse, errors=(*BODY_ERRORS, 429, 503)),
      summary="Compute a prefix now and retain it for ttl seconds")
async def cache_retain(request: Request) -> Response:
    state, req, ids = await _read(request)
    engine = state.require_engine()
    ttl = req.ttl
    if not 0 < ttl <= RETENTION_MAX_S:
        raise OpenAIError(400, f"ttl must be in (0, {RETENTION_MAX_S:.0f}] seconds, got {ttl}.", param="ttl")
    params = SamplingParams(max_tokens=1, temperature=0.0, cache_breakpoints=((len(ids), float(ttl)),))
    state.admit(engine, 1)
    run = await Run.start(engine, state.metrics, [{"prompt_token_ids": ids}], params, f"retain-{uuid.uuid4().hex}",
                          priority=0, cache_salt=req.cache_salt, max_queued=state.max_queued_requests)
    out, _ = await run.final_choice(request)
    found = await engine.cache_lookup(ids, cache_salt=req.cache_salt, remote=False)
    return _json(CacheRetainResponse(len(ids), found["retained_tokens"], len(ids) - out.num_cached_tokens, ttl))


@post("/v1/cache/release", status_code=200, guards=[require_api_key], tags=["Cache"],
      operation_class=api_operation(CacheRequest, CacheReleaseResponse, errors=BODY_ERRORS),
      summary="End a prefix's retention")
async def cache_release(request: Request) -> Response:
    state, req, ids = await _read(request)
    released = await state.require_engine().cache_release(ids, cache_salt=req.cache_salt)
    return _json(CacheReleaseResponse(released))


@post("/v1/cache/check", status_code=200, guards=[require_api_key], tags=["Cache"],
      operation_class=api_operation(None, CacheCheckResponse, errors=(401,)),
      summary="Check the KV cache's invariants and count its blocks")
async def cache_check(request: Request) -> Response:
    report = await _state(request).require_engine().integrity_report()
    return _json(CacheCheckResponse(**report))


CACHE_ROUTES = [cache_lookup, cache_retain, cache_release, cache_check]
