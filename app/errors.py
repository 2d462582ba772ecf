"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure leaves the server in this shape: our own `OpenAIError`, the engine's typed errors
(InvalidRequestError -> 400 with its param, ContextLengthExceededError -> 400
context_length_exceeded), Litestar's own 404/405/413/validation errors, and anything unexpected
(500, logged). Headers such as Retry-After are kept. A request shed under load (EngineOverloadedError:
--max-queued-requests) is a 503 with code `overloaded` and Retry-After, on the Anthropic routes a 529
`overloaded_error`, as Anthropic's API answers.
"""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from engine.errors import ContextLengthExceededError, EngineDeadError, EngineOverloadedError, InvalidRequestError

logger = logging.getLogger("prefixserve.server")

# status -> (type, default code): the types OpenAI's API uses.
_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    422: ("invalid_request_error", None),
    429: ("rate_limit_exceeded", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
}
OVERLOADED = "overloaded"  # the code of a request shed under load (503; Anthropic's routes: 529)
OVERLOADED_RETRY_AFTER_S = "1"


class OpenAIError(HTTPException):
    """An error the API reports to its client in OpenAI's shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail=message, status_code=status_code, headers=headers)
        kind, default_code = _KINDS.get(status_code, ("server_error" if status_code >= 500 else
                                                       "invalid_request_error", None))
        self.message = message
        self.param = param
        self.code = code if code is not None else default_code
        self.type = type or kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_exception(exc: BaseException) -> OpenAIError:
    """Map any exception onto the OpenAIError a client should see."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        return OpenAIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        return OpenAIError(503, f"The server is overloaded ({exc.num_waiting} requests waiting, "
                           f"--max-queued-requests {exc.limit}); retry later.", code=OVERLOADED,
                           headers={"Retry-After": OVERLOADED_RETRY_AFTER_S})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"The engine is not running: {exc}", headers={"Retry-After": "5"})
    if isinstance(exc, HTTPException):
        status = exc.status_code
        message = exc.detail or HTTPStatus(status).phrase
        param = None
        if status == 404:
            message = f"Not found: {message}" if message != "Not Found" else "The requested resource was not found."
        elif status == 413:
            message = "The request body is too large."
        elif isinstance(exc.extra, list) and exc.extra:  # Litestar validation errors: name the field
            first = exc.extra[0]
            if isinstance(first, dict):
                param = first.get("key")
                message = f"{message}: {first.get('message', '')}".rstrip(": ")
        return OpenAIError(status, message, param=param, headers=dict(exc.headers or {}))
    return OpenAIError(500, f"Internal server error: {type(exc).__name__}: {exc}")


# Anthropic's error types by status (the Messages API's routes answer in its shape).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_body(error: OpenAIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, as Anthropic's API and its SDK expect."""
    kind = _ANTHROPIC_TYPES.get(error.status_code, "api_error" if error.status_code >= 500 else "invalid_request_error")
    message = f"{error.param}: {error.message}" if error.param and error.param not in error.message else error.message
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: OpenAIError, anthropic: bool = False) -> Response:
    status = error.status_code
    if anthropic and error.code == OVERLOADED:
        status = 529  # Anthropic's "overloaded" status (its SDK raises OverloadedError)
    return Response(
        content=msgspec.json.encode(anthropic_body(error) if anthropic else error.body()),
        status_code=status,
        media_type="application/json",
        headers=dict(error.headers or {}),
    )


def handle_exception(request: Request, exc: Exception) -> Response:
    """The app-wide exception handler (registered for Exception: covers HTTPException too)."""
    error = from_exception(exc)
    if error.status_code == 503 and isinstance(exc, (OpenAIError, EngineOverloadedError)):
        # Not ready (loading, draining), or shed under load (counted in /metrics): not an error to log
        logger.debug("%s %s: %s", request.method, request.url.path, error.message)
    elif error.status_code >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, error.message,
                     exc_info=not isinstance(exc, (HTTPException, EngineDeadError)))
    return error_response(error, anthropic=request.url.path.startswith(ANTHROPIC_PATHS))


def sse_error(exc: BaseException) -> bytes:
    """An error after the stream began: one `data: {"error": ...}` event (the stream then ends)."""
    return b"data: " + msgspec.json.encode(from_exception(exc).body()) + b"\n\n"
