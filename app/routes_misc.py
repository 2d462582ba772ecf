"""Operational endpoints: /health, /metrics, /version, and vLLM's /tokenize, /detokenize and
/reset_prefix_cache."""
from __future__ import annotations

from importlib import metadata

from litestar import Request, Response, get, post

from app.auth import require_api_key
from app.errors import OpenAIError
from app.openapi import BODY_ERRORS, DETOKENIZE_EXAMPLES, TOKENIZE_EXAMPLES, api_operation
from app.protocol import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, VersionResponse, decode_request, encode,
)
from app.serving import chat_conversation, render_chat
from app.state import RETRY_AFTER_S, ServerState
from engine.tool_calls import parse_tool_request


def package_version() -> str:
    try:
        return metadata.version("prefixserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _json(payload) -> Response:
    return Response(content=encode(payload), media_type="application/json", status_code=200)


@get("/health", tags=["Operations"], summary="Liveness / readiness",
     operation_class=api_operation(errors=(503,), ok="Ready (empty body)."))
async def health(request: Request) -> Response:
    """200 (empty body) when the engine is ready; 503 while loading, draining, or after the engine died."""
    state = _state(request)
    if not state.ready:
        raise OpenAIError(503, state.not_ready_reason(), headers={"Retry-After": RETRY_AFTER_S})
    return Response(content=b"", status_code=200)


@get("/metrics", tags=["Operations"], summary="Prometheus metrics",
     operation_class=api_operation(media_type="text/plain", ok="Prometheus text exposition format."))
async def metrics(request: Request) -> Response:
    body, content_type = _state(request).metrics.render()
    # The header verbatim: given as media_type, Litestar would append a second "; charset=utf-8".
    return Response(content=body, status_code=200, headers={"content-type": content_type})


@get("/version", tags=["Operations"], summary="Server version",
     operation_class=api_operation(response=VersionResponse))
async def version() -> Response:
    return _json(VersionResponse(package_version()))


@post("/tokenize", status_code=200, guards=[require_api_key], tags=["Tokenizer"],
      operation_class=api_operation(TokenizeRequest, TokenizeResponse, errors=BODY_ERRORS,
                                    examples=TOKENIZE_EXAMPLES),
      summary="Tokenize a prompt or chat messages")
async def tokenize(request: Request) -> Response:
    state = _state(request)
    engine = state.require_engine()
    req = decode_request(await request.body(), TokenizeRequest)
    state.model_name(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "Pass exactly one of prompt and messages.", param="prompt")
    if req.messages is not None:
        ids = render_chat(state.tool_chat, chat_conversation(req.messages),
                          add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
                          continue_final_message=False, template_kwargs=None, tools=parse_tool_request(req.tools))
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = engine.tokenize(req.prompt, add_special_tokens=add_special)
    strs = engine.token_strings(ids) if req.return_token_strs else None
    return _json(TokenizeResponse(len(ids), engine.model_info.max_model_len, ids, strs))


@post("/detokenize", status_code=200, guards=[require_api_key], tags=["Tokenizer"],
      operation_class=api_operation(DetokenizeRequest, DetokenizeResponse, errors=BODY_ERRORS,
                                    examples=DETOKENIZE_EXAMPLES),
      summary="Detokenize token ids")
async def detokenize(request: Request) -> Response:
    state = _state(request)
    engine = state.require_engine()
    req = decode_request(await request.body(), DetokenizeRequest)
    state.model_name(req.model)
    return _json(DetokenizeResponse(engine.detokenize(req.tokens)))


@post("/reset_prefix_cache", status_code=200, guards=[require_api_key], tags=["Operations"],
      summary="Forget every cached KV block (vLLM's /reset_prefix_cache)",
      operation_class=api_operation(errors=(401, 409, 503), ok="The device pool and the host tier hold no cached "
                                    "block (KV-event subscribers get AllBlocksCleared); empty body."))
async def reset_prefix_cache(request: Request) -> Response:
    """As vLLM's: for benchmarks and after weight changes. Refused (409) while requests hold blocks,
    so no running request loses its cache; the shared Redis tier is left alone."""
    engine = _state(request).require_engine()
    if not await engine.reset_prefix_cache():
        raise OpenAIError(409, "Requests are running; reset the prefix cache when the server is idle.",
                          code="requests_running")
    return Response(content=b"", status_code=200)


MISC_ROUTES = [health, metrics, version, tokenize, detokenize, reset_prefix_cache]
