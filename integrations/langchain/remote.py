"""The remote backend: a prefixserve server (or any OpenAI-compatible one) over HTTP.

Uses the official `openai` client, which brings connection pooling, `timeout`, and retries with
backoff on 408/409/429/5xx and connection errors (`max_retries`). Streams ask for
`stream_options={"include_usage": true}`, so the final usage (with the prefix-cache hits in
`prompt_tokens_details.cached_tokens`) always arrives. prefixserve's own fields (`top_k`, `min_p`,
`repetition_penalty`, `cache_salt`, anything in `extra`) travel in `extra_body`.
"""
from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import openai

from integrations.langchain._types import (
    CallOptions,
    Choice,
    Completion,
    Delta,
    StreamEnd,
    ToolCall,
    ToolCallDelta,
    Usage,
)

_BODY_FIELDS = ("temperature", "top_p", "max_tokens", "seed", "presence_penalty", "frequency_penalty")
_EXTRA_BODY_FIELDS = ("top_k", "min_p", "repetition_penalty")


def openai_base_url(base_url: str) -> str:
    """`http://host:port` -> `http://host:port/v1` (the OpenAI routes); a URL with a path is kept as is."""
    url = base_url.rstrip("/")
    return url + "/v1" if urlsplit(url).path in ("", "/") else url


def _usage(usage: Any) -> Usage:
    if usage is None:
        return Usage(0, 0, 0)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return Usage(usage.prompt_tokens or 0, usage.completion_tokens or 0, cached or 0)


def _logprobs(logprobs: Any) -> list[dict[str, Any]] | None:
    if logprobs is None or not logprobs.content:
        return None
    return [entry.model_dump() for entry in logprobs.content]


class RemoteBackend:
    """The OpenAI-compatible /v1/chat/completions of one server."""

    def __init__(self, *, base_url: str, api_key: str | None, timeout: float | None, max_retries: int,
                 default_model: str | None, http_client: Any = None, http_async_client: Any = None) -> None:
        self._settings = {"base_url": openai_base_url(base_url), "api_key": api_key or "unused",
                          "max_retries": max_retries}
        if timeout is not None:
            self._settings["timeout"] = timeout
        self._default_model = default_model
        self._http_client = http_client
        self._http_async_client = http_async_client
        self._client: openai.OpenAI | None = None
        self._async_client: openai.AsyncOpenAI | None = None
        self._lock = threading.Lock()

    def default_model_name(self) -> str | None:
        return self._default_model

    @property
    def client(self) -> openai.OpenAI:
        with self._lock:
            if self._client is None:
                self._client = openai.OpenAI(**self._settings, http_client=self._http_client)
            return self._client

    @property
    def async_client(self) -> openai.AsyncOpenAI:
        with self._lock:
            if self._async_client is None:
                self._async_client = openai.AsyncOpenAI(**self._settings, http_client=self._http_async_client)
            return self._async_client

    def body(self, messages: list[dict], options: CallOptions, *, stream: bool) -> dict[str, Any]:
        """The keyword arguments of `chat.completions.create` for one call."""
        body: dict[str, Any] = {"model": options.model or self._default_model or "", "messages": messages}
        if options.n != 1:
            body["n"] = options.n
        for name in _BODY_FIELDS:
            if name in options.sampling:
                body[name] = options.sampling[name]
        if options.stop:
            body["stop"] = options.stop
        if options.logprobs:
            body["logprobs"] = True
            if options.top_logprobs is not None:
                body["top_logprobs"] = options.top_logprobs
        if options.tools:
            body["tools"] = options.tools
            if options.tool_choice is not None:
                body["tool_choice"] = options.tool_choice
            if options.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = options.parallel_tool_calls
        if options.response_format is not None:
            body["response_format"] = options.response_format
        extra = {name: options.sampling[name] for name in _EXTRA_BODY_FIELDS if name in options.sampling}
        if options.cache_salt is not None:
            extra["cache_salt"] = options.cache_salt
        extra.update(options.extra)
        if extra:
            body["extra_body"] = extra
        if options.timeout is not None:
            body["timeout"] = options.timeout
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    # -- the backend contract ------------------------------------------------------------------
    def complete(self, messages: list[dict], options: CallOptions) -> Completion:
        return self._completion(self.client.chat.completions.create(**self.body(messages, options, stream=False)))

    async def acomplete(self, messages: list[dict], options: CallOptions) -> Completion:
        response = await self.async_client.chat.completions.create(**self.body(messages, options, stream=False))
        return self._completion(response)

    def stream(self, messages: list[dict], options: CallOptions) -> Iterator[Delta | StreamEnd]:
        state = _StreamState(options.model or self._default_model or "")
        with self.client.chat.completions.create(**self.body(messages, options, stream=True)) as chunks:
            for chunk in chunks:
                yield from state.events(chunk)
        yield state.end()

    async def astream(self, messages: list[dict], options: CallOptions) -> AsyncIterator[Delta | StreamEnd]:
        state = _StreamState(options.model or self._default_model or "")
        chunks = await self.async_client.chat.completions.create(**self.body(messages, options, stream=True))
        async with chunks:
            async for chunk in chunks:
                for event in state.events(chunk):
                    yield event
        yield state.end()

    def close(self) -> None:
        """Close the sync client's connection pool (unless the caller gave the HTTP client); the async
        client's pool closes with its event loop."""
        with self._lock:
            client, self._client, self._async_client = self._client, None, None
        if client is not None and self._http_client is None:
            client.close()

    @staticmethod
    def _completion(response: Any) -> Completion:
        choices = []
        for c in response.choices:
            calls = tuple(ToolCall(tc.id, tc.function.name, tc.function.arguments or "")
                          for tc in (c.message.tool_calls or ()) if getattr(tc, "function", None) is not None)
            choices.append(Choice(c.index, c.message.content or "", c.finish_reason, calls, _logprobs(c.logprobs)))
        return Completion(response.model, choices, _usage(response.usage), response.id)


class _StreamState:
    """The finish reason, model and usage of one stream, gathered as its chunks pass."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.id: str | None = None

    def events(self, chunk: Any) -> Iterator[Delta]:
        self.model = chunk.model or self.model
        self.id = chunk.id or self.id
        if chunk.usage is not None:
            self.usage = _usage(chunk.usage)
        for c in chunk.choices:  # n == 1: one choice per chunk at most
            delta = c.delta
            calls = tuple(
                ToolCallDelta(tc.index, tc.id, tc.function.name if tc.function else None,
                              (tc.function.arguments if tc.function else None) or "")
                for tc in (delta.tool_calls or ())
            )
            logprobs = _logprobs(c.logprobs)
            if c.finish_reason is not None:
                self.finish_reason = c.finish_reason
            if delta.content or calls or logprobs:
                yield Delta(delta.content or "", calls, logprobs)

    def end(self) -> StreamEnd:
        return StreamEnd(self.model, self.usage or Usage(0, 0, 0), self.finish_reason, self.id)
