"""prefixserve failures as `langchain_core.exceptions` types.

Every exception ChatPrefixServe raises on purpose is a LangChain `ModelError` subclass that *also*
subclasses the error its backend raised (as LangChain's own provider packages do), so callers can
catch either side: `except ContextOverflowError` (portable across providers) or
`except engine.ContextLengthExceededError` / `except openai.BadRequestError` (backend-specific).

    in-process (engine/errors.py)          remote (the server's OpenAI error shape)
    ContextLengthExceededError  ->  ContextOverflowError   <-  400 code "context_length_exceeded"
    InvalidRequestError         ->  ModelInvalidRequestError  <-  400 / 422 / 413
    (model folder not found)    ->  ModelNotFoundError     <-  404 (unknown model)
                                    ModelRateLimitError    <-  429 (server at capacity)
    EngineDeadError, step error ->  ModelAPIError          <-  5xx, 503 (loading, draining)
    (timeout)                   ->  ModelTimeoutError      <-  client timeout
                                    ModelConnectionError   <-  connection refused / reset
                                    ModelAuthenticationError  <-  401 (--api-key)
"""
from __future__ import annotations

from typing import Any

import openai
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelAuthenticationError,
    ModelConnectionError,
    ModelError,
    ModelInvalidRequestError,
    ModelNotFoundError,
    ModelPermissionDeniedError,
    ModelRateLimitError,
    ModelTimeoutError,
)

from engine import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidConfigError,
    InvalidRequestError,
    PrefixServeError,
)

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class InvalidOptionError(ValueError, ModelInvalidRequestError):
    """An option the chat model itself rejects before any request (e.g. streaming with n > 1)."""


# -- in-process ----------------------------------------------------------------------------
class EngineContextOverflowError(ContextLengthExceededError, ContextOverflowError):
    """The prompt plus max_tokens does not fit the engine's context or KV pool."""


class EngineInvalidRequestError(InvalidRequestError, ModelInvalidRequestError):
    """The engine rejected the request (bad sampling parameter, unsupported message, ...)."""


class EngineModelNotFoundError(FileNotFoundError, ModelNotFoundError):
    """The model (name, folder or .gguf) of an in-process engine could not be found."""


class EngineAPIError(PrefixServeError, ModelAPIError):
    """The engine failed while running the request (a failed step); the request was aborted."""


class EngineUnavailableError(EngineDeadError, ModelAPIError):
    """The engine loop stopped; this engine serves no further requests."""

    is_retryable = False


class EngineTimeoutError(PrefixServeError, TimeoutError, ModelTimeoutError):
    """The request ran past `timeout`; it was aborted and its KV blocks freed."""


def from_engine_error(exc: BaseException) -> BaseException:
    """The LangChain-typed error for an exception of the in-process engine (or `exc` itself)."""
    if isinstance(exc, ModelError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        return EngineContextOverflowError(str(exc), param=exc.param)
    if isinstance(exc, InvalidRequestError):
        return EngineInvalidRequestError(str(exc), param=exc.param)
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError(str(exc))
    if isinstance(exc, PrefixServeError):  # EngineStepError and future engine failures
        return EngineAPIError(str(exc))
    return exc


def from_engine_load_error(exc: BaseException) -> BaseException:
    """Errors of building an engine for `model=`: a missing model is ModelNotFoundError, a bad
    option ModelInvalidRequestError."""
    if isinstance(exc, FileNotFoundError):
        return EngineModelNotFoundError(str(exc))
    if isinstance(exc, InvalidConfigError):
        return EngineInvalidRequestError(str(exc), param="engine_kwargs")
    return from_engine_error(exc)


# -- remote ------------------------------------------------------------------------------------
class ServerContextOverflowError(openai.BadRequestError, ContextOverflowError):
    """400 context_length_exceeded from a prefixserve (or any OpenAI-compatible) server."""


class ServerStreamContextOverflowError(openai.APIError, ContextOverflowError):
    """context_length_exceeded reported in a stream's error event."""


class ServerInvalidRequestError(openai.BadRequestError, ModelInvalidRequestError):
    """400: the server rejected the request."""


class ServerUnprocessableError(openai.UnprocessableEntityError, ModelInvalidRequestError):
    """422: the server could not process the request body."""


class ServerAuthenticationError(openai.AuthenticationError, ModelAuthenticationError):
    """401: missing or wrong api_key (the server runs with --api-key)."""


class ServerPermissionDeniedError(openai.PermissionDeniedError, ModelPermissionDeniedError):
    """403."""


class ServerModelNotFoundError(openai.NotFoundError, ModelNotFoundError):
    """404: the server does not serve this model name."""


class ServerRateLimitError(openai.RateLimitError, ModelRateLimitError):
    """429: the server is at capacity (its waiting queue is full); retry after Retry-After."""


class ServerAPIError(openai.InternalServerError, ModelAPIError):
    """5xx: 503 while the model loads, while draining, or after the engine died; 500 otherwise."""


class ServerStreamError(openai.APIError, ModelAPIError):
    """An error event in the middle of a stream (the server failed after the response began)."""


class ServerConnectionError(openai.APIConnectionError, ModelConnectionError):
    """The server could not be reached."""


class ServerTimeoutError(openai.APITimeoutError, ModelTimeoutError):
    """The request ran past `timeout`."""


def _status_kwargs(exc: openai.APIStatusError) -> dict[str, Any]:
    return {"message": exc.message, "response": exc.response, "body": exc.body}


def _is_context_overflow(exc: openai.APIError) -> bool:
    return getattr(exc, "code", None) == CONTEXT_LENGTH_EXCEEDED or CONTEXT_LENGTH_EXCEEDED in str(exc.body or "")


def from_openai_error(exc: BaseException) -> BaseException:
    """The LangChain-typed error for an exception of the openai client (or `exc` itself)."""
    if isinstance(exc, ModelError) or not isinstance(exc, openai.OpenAIError):
        return exc
    if isinstance(exc, openai.APITimeoutError):  # before APIConnectionError, its base class
        return ServerTimeoutError(request=exc.request)
    if isinstance(exc, openai.APIConnectionError):
        return ServerConnectionError(message=exc.message, request=exc.request)
    if isinstance(exc, openai.BadRequestError):
        if _is_context_overflow(exc):
            return ServerContextOverflowError(**_status_kwargs(exc))
        return ServerInvalidRequestError(**_status_kwargs(exc))
    for openai_type, ours in (
        (openai.UnprocessableEntityError, ServerUnprocessableError),
        (openai.AuthenticationError, ServerAuthenticationError),
        (openai.PermissionDeniedError, ServerPermissionDeniedError),
        (openai.NotFoundError, ServerModelNotFoundError),
        (openai.RateLimitError, ServerRateLimitError),
        (openai.InternalServerError, ServerAPIError),
    ):
        if isinstance(exc, openai_type):
            return ours(**_status_kwargs(exc))
    if isinstance(exc, openai.APIStatusError):  # 413 and other 4xx
        return ServerInvalidRequestError(**_status_kwargs(exc)) if exc.status_code < 500 \
            else ServerAPIError(**_status_kwargs(exc))
    if isinstance(exc, openai.APIError):  # an error event inside a stream
        if _is_context_overflow(exc):
            return ServerStreamContextOverflowError(exc.message, exc.request, body=exc.body)
        return ServerStreamError(exc.message, exc.request, body=exc.body)
    return exc
