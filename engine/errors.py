"""Typed exceptions of the engine's public API.

The server maps them onto OpenAI error shapes; Python users catch them directly.
Every one subclasses ValueError or RuntimeError so generic handlers still work.
"""
from __future__ import annotations


class PrefixServeError(Exception):
    """Base class of every error prefixserve raises on purpose."""


class InvalidRequestError(PrefixServeError, ValueError):
    """A request (prompt or sampling parameters) is malformed. `param` names the culprit."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """The prompt plus the requested output can never fit in max_model_len or the KV pool."""


class InvalidConfigError(PrefixServeError, ValueError):
    """An EngineConfig value is out of range or inconsistent."""


class EngineDeadError(PrefixServeError, RuntimeError):
    """The engine loop stopped; no further requests can be served."""


class EngineOverloadedError(PrefixServeError, RuntimeError):
    """The engine refused a request because `max_queued` requests were already waiting (queued, not yet
    running); nothing of the request was queued. Retry later (the server answers 503 / Anthropic's 529)."""

    def __init__(self, message: str, *, num_waiting: int, limit: int) -> None:
        super().__init__(message)
        self.num_waiting = num_waiting
        self.limit = limit
