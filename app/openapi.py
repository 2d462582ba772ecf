"""OpenAPI for routes that decode their own bodies (strictly, with msgspec) and encode their own
responses: the request and response schemas come from msgspec.json.schema, inlined (our wire types
are not recursive), and are attached to the operation together with every error status the route
can answer, each with the OpenAI error body. Routes declare it with
`operation_class=api_operation(Request, Response, stream=Chunk, errors=...)`.

The docs pages (Swagger UI, Redoc) and their assets are app/docs.py.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import (
    Components, Example, OpenAPIHeader, OpenAPIMediaType, OpenAPIResponse, Operation, RequestBody, SecurityScheme,
)

from app.protocol import ErrorResponse

# What each error status means on this server (app/errors.py maps every failure onto one of them).
ERROR_DESCRIPTIONS = {
    400: "Invalid request: a field has a bad value or type, or the prompt is too long (`param` names the field).",
    401: "Missing or wrong API key (the server was started with --api-key).",
    404: "The model is not served here.",
    409: "The server's state does not allow it now (a prefix-cache reset while requests hold KV blocks).",
    413: "The request body is larger than the server accepts.",
    429: "Overloaded: too many requests in flight. Retry after Retry-After seconds.",
    503: "The model is still loading, the server is draining, the engine stopped, or the request was shed "
         "(--max-queued-requests requests already waiting; code `overloaded`). Retry after Retry-After seconds.",
    529: "Overloaded (Anthropic's status): --max-queued-requests requests were already waiting, so this one was "
         "refused before it was queued. Retry after Retry-After seconds.",
}
_RETRY_AFTER = {429, 503, 529}
# The statuses each kind of route answers besides 200.
GENERATE_ERRORS = (400, 401, 404, 413, 429, 503)  # /v1/completions, /v1/chat/completions
BODY_ERRORS = (400, 401, 404, 413, 503)  # /tokenize, /detokenize
LIST_ERRORS = (401, 503)
MODEL_ERRORS = (401, 404, 503)
# Request examples (no `model`: it defaults to the first served name).
_HELLO = [{"role": "user", "content": "Say hello."}]
COMPLETION_EXAMPLES = {
    "text": {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7},
    "stream": {"prompt": "Once upon a time", "max_tokens": 16, "stream": True,
               "stream_options": {"include_usage": True}},
}
CHAT_EXAMPLES = {
    "chat": {"messages": _HELLO, "max_tokens": 16},
    "stream": {"messages": _HELLO, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}},
    "json": {"messages": _HELLO, "max_tokens": 32, "response_format": {"type": "json_object"}},
}
TOKENIZE_EXAMPLES = {"prompt": {"prompt": "Hello world"}, "chat": {"messages": _HELLO}}
DETOKENIZE_EXAMPLES = {"tokens": {"tokens": [19556, 905]}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def request_schema(kind: type) -> dict[str, Any]:
    """`kind`'s JSON schema, self-contained (also used for response types)."""
    schema = msgspec.json.schema(kind)
    return _inline(schema, schema.get("$defs", {}))


def _json(schema: dict[str, Any]) -> dict[str, OpenAPIMediaType]:
    return {"application/json": OpenAPIMediaType(schema=schema)}  # type: ignore[arg-type]


def _error(status: int, body: type | None = None) -> OpenAPIResponse:
    headers = None
    if status in _RETRY_AFTER:
        headers = {"Retry-After": OpenAPIHeader(schema={"type": "string"},  # type: ignore[arg-type]
                                                description="Seconds to wait before retrying.")}
    return OpenAPIResponse(description=ERROR_DESCRIPTIONS[status], content=_json(request_schema(body or ErrorResponse)),
                           headers=headers)


def _sse_event(chunk: type) -> dict[str, Any]:
    """One server-sent event of a stream=true response (before OpenAPI 3.2, `schema` describes each
    event): `data:` holds a chunk as JSON, or one error object after the stream began, and the last
    event is `data: [DONE]`."""
    payload = {"anyOf": [request_schema(chunk), request_schema(ErrorResponse)]}
    return {
        "type": "object", "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]}},
        "description": f"Server-sent events (stream=true): each `data:` is a {chunk.__name__}, then `[DONE]`.",
    }


def _ok(response: type | None, stream: type | None, media_type: str | None, description: str) -> OpenAPIResponse:
    content: dict[str, OpenAPIMediaType] = {}
    if response is not None:
        content.update(_json(request_schema(response)))
    if stream is not None:
        content["text/event-stream"] = OpenAPIMediaType(schema=_sse_event(stream))  # type: ignore[arg-type]
    elif media_type is not None:
        content[media_type] = OpenAPIMediaType(schema={"type": "string"})  # type: ignore[arg-type]
    return OpenAPIResponse(description=description, content=content or None)


def api_operation(request: type | None = None, response: type | None = None, *, stream: type | None = None,
                  media_type: str | None = None, errors: Iterable[int] = (), ok: str = "OK",
                  examples: dict[str, dict] | None = None, error_body: type | None = None) -> type[Operation]:
    """An Operation class documenting the request body (`request`'s schema, with `examples` of it by
    name; the handler reads the raw body), the 200 response (`response` as JSON, `stream` chunks as
    SSE, or a `media_type` text body) and each status in `errors` with the OpenAI error body."""
    request_body = None
    if request is not None:
        content = _json(request_schema(request))
        if examples:  # Swagger UI's "Try it out" starts from them; schemathesis sends them as cases
            content["application/json"].examples = {name: Example(summary=name, value=value)
                                                    for name, value in examples.items()}
        request_body = RequestBody(content=content, required=True)
    responses = {"200": _ok(response, stream, media_type, ok)}
    responses.update({str(status): _error(status, error_body) for status in sorted(errors)})
    # Routes that can answer 401 take the --api-key as a bearer token; `{}`: none when the server has no key.
    security = [{"bearer": []}, {}] if "401" in responses else None
    name = "".join(t.__name__ for t in (request, response) if t is not None) or "Plain"

    @dataclass
    class _ApiOperation(Operation):
        def __post_init__(self) -> None:
            if request_body is not None and self.request_body is None:
                self.request_body = request_body
            self.responses = dict(responses)  # ours replace Litestar's guess from `-> Response`
            if security is not None:
                self.security = list(security)

    _ApiOperation.__name__ = f"{name}Operation"
    return _ApiOperation


def body_operation(kind: type) -> type[Operation]:
    """An Operation class whose request body is `kind`'s schema (the handler reads the raw body)."""
    return api_operation(kind, errors=BODY_ERRORS)


def openapi_config(version: str, render_plugins=()) -> OpenAPIConfig:
    return OpenAPIConfig(
        title="prefixserve", version=version, path="/schema", render_plugins=list(render_plugins),
        # Swagger UI's "Authorize" button: the --api-key, sent as `Authorization: Bearer <key>`.
        components=Components(security_schemes={"bearer": SecurityScheme(
            type="http", scheme="bearer", description="The server's --api-key (when it was started with one).")}),
        description="OpenAI-compatible API of prefixserve (plus vLLM's /tokenize, /detokenize, /version).",
    )
