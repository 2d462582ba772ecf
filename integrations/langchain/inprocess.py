"""The in-process backend: an engine in this process, no HTTP.

Three ways in, one contract out (see _types.py):

* `engine=AsyncEngine(...)`: the engine loop runs in its own thread; async calls consume
  `AsyncEngine.generate` directly, sync calls through a helper thread with its own event loop.
  Concurrent calls (`batch`, `abatch`, several agents) are batched by the engine.
* `llm=LLM(...)`: the offline LLM's engine, driven like the server's: through the AsyncEngine the
  LLM hands out (`LLM.as_async_engine()`), whose loop thread this backend starts on first use and
  stops on close. Do not call `llm.generate` while the chat model is in use (one engine, one driver).
* `model="name-or-path"`: the process's shared AsyncEngine for `EngineConfig(model=...,
  **engine_kwargs)` (shared_engines.py), built on first use; every chat model with the same model and
  engine settings uses the same engine and prefix cache; when the last one closes (or is garbage
  collected) the engine stays up, idle, for the registry's idle timeout. A per-call `model=` naming another model leases that model's engine.

Prompts are rendered by the engine's tool layer (`ToolChat`): the model's chat template, tools
described in its native format or in a system-prompt section, and a grammar constraint that makes a
forced tool call always valid. `response_format` becomes `StructuredOutputsParams`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from engine import (
    LLM,
    AsyncEngine,
    EngineConfig,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    ToolChat,
)
from engine import openai_compat
from integrations.langchain._bridge import iterate_in_thread
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
from integrations.langchain.errors import EngineAPIError, EngineTimeoutError, from_engine_load_error
from integrations.langchain.shared_engines import shared_engines, shutdown_engine

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
LARGE_PROMPT_CHARS = 64 * 1024  # rendering + tokenizing more than this leaves the event loop (as the server does)
_PASSED_THROUGH = ("temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


# -- options -> engine request -------------------------------------------------------------------
def sampling_params(options: CallOptions) -> SamplingParams:
    """The SamplingParams of one call: the OpenAI mapping the server uses (engine/openai_compat.py;
    max_tokens None: up to the context end), then any SamplingParams field given as an extra keyword."""
    fields = {name: options.sampling[name] for name in _PASSED_THROUGH if name in options.sampling}
    fields.update(n=options.n, stop=options.stop, response_format=options.response_format)
    logprobs = (options.top_logprobs or 0) if options.logprobs else None
    params = openai_compat.sampling_params(fields, max_tokens=options.sampling.get("max_tokens"), logprobs=logprobs,
                                           vocab_size=None)
    for key in options.extra:
        if key not in _SAMPLING_FIELDS:
            raise InvalidRequestError(f"{key!r} is not an option of the in-process engine (SamplingParams).",
                                      param=key)
    return dataclasses.replace(params, **options.extra) if options.extra else params


chat_logprobs = openai_compat.chat_logprobs


def _num_chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in messages)


# -- runners: one engine each ---------------------------------------------------------------------
class _Runner:
    """One engine: its tool layer and its request outputs, sync and async."""

    tool_chat: ToolChat
    engine: AsyncEngine

    def decode(self, token: int) -> str:
        return self.engine.decode_token(token)

    async def outputs(self, prompt: list[int], params: SamplingParams, cache_salt: str | None,
                      deadline: float | None) -> AsyncIterator[RequestOutput]:
        raise NotImplementedError

    def iter_outputs(self, prompt: list[int], params: SamplingParams, cache_salt: str | None,
                     deadline: float | None) -> Iterator[RequestOutput]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what this runner owns (an engine it built)."""


class _AsyncEngineRunner(_Runner):
    def __init__(self, engine: AsyncEngine, *, release: Callable[[], None] | None) -> None:
        self.engine = engine
        self._release = release  # what closing this runner does: None for an engine the caller owns
        self.tool_chat = engine.tool_chat

    async def outputs(self, prompt, params, cache_salt, deadline):
        stream = self.engine.generate({"prompt_token_ids": prompt}, params, cache_salt=cache_salt)
        try:
            while True:
                try:
                    if deadline is None:
                        out = await stream.__anext__()
                    else:  # a timed-out __anext__ is cancelled: the engine request is aborted
                        out = await asyncio.wait_for(stream.__anext__(), max(deadline - time.monotonic(), 0.0))
                except StopAsyncIteration:
                    raise EngineAPIError("The engine aborted the request before it finished.") from None
                except TimeoutError:
                    raise EngineTimeoutError("The request timed out; it was aborted.") from None
                yield out
                if out.finished:
                    return
        finally:
            await stream.aclose()

    def iter_outputs(self, prompt, params, cache_salt, deadline):
        return iterate_in_thread(lambda: self.outputs(prompt, params, cache_salt, deadline))

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


# -- the backend -----------------------------------------------------------------------------------
class _Call:
    """One call in flight: its prompt and params, and the conversion of its outputs."""

    def __init__(self, runner: _Runner, model: str, messages: list[dict], options: CallOptions) -> None:
        self.runner = runner
        self.model = model
        self.options = options
        self.prepared = runner.tool_chat.prepare(messages, options.tools, options.tool_choice,
                                                 options.parallel_tool_calls)
        self.params = self.prepared.apply(sampling_params(options))
        self.deadline = time.monotonic() + options.timeout if options.timeout else None
        self.k = (options.top_logprobs or 0) if options.logprobs else None
        # streaming state (n == 1)
        self._parser = self.prepared.stream_parser()
        self._text_len = 0
        self._num_tokens = 0
        self._num_calls = 0

    @property
    def prompt(self) -> list[int]:
        return self.prepared.prompt_token_ids

    def usage(self, out: RequestOutput) -> Usage:
        return Usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens,
                     out.num_retained_tokens)

    def completion(self, out: RequestOutput | None) -> Completion:
        if out is None or not out.finished:
            raise EngineAPIError("The engine aborted the request before it finished.")
        choices = []
        for c in out.outputs:
            if c.finish_reason == "abort":
                raise EngineAPIError("The engine aborted the request before it finished.")
            message = self.prepared.parse(c.text)
            calls = tuple(ToolCall(call.id, call.name, call.arguments) for call in message.tool_calls)
            logprobs = None
            if self.k is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs or [], self.k, self.runner.decode)
            choices.append(Choice(c.index, message.content or "", message.finish_reason(c.finish_reason), calls,
                                  logprobs))
        return Completion(self.model, choices, self.usage(out), out.request_id)

    def deltas(self, out: RequestOutput) -> Iterator[Delta | StreamEnd]:
        """What `out` (a cumulative output of an n == 1 request) adds to the stream."""
        c = out.outputs[0]
        if c.finish_reason == "abort":
            raise EngineAPIError("The engine aborted the request before it finished.")
        text = c.text[self._text_len:] if len(c.text) > self._text_len else ""
        self._text_len = max(self._text_len, len(c.text))
        start, end = self._num_tokens, len(c.token_ids)
        self._num_tokens = end
        events = self._parser.feed(text)
        if c.finish_reason is not None:
            events += self._parser.finish()
        logprobs = None
        if self.k is not None and end > start and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids[start:end], c.logprobs[start:end], self.k, self.runner.decode)
        pieces = "".join(e for e in events if isinstance(e, str))
        calls = []
        for call in (e for e in events if not isinstance(e, str)):
            calls.append(ToolCallDelta(self._num_calls, call.id, call.name, call.arguments))
            self._num_calls += 1
        if pieces or calls or logprobs:
            yield Delta(pieces, tuple(calls), logprobs)
        if out.finished:
            yield StreamEnd(self.model, self.usage(out), self._parser.finish_reason(c.finish_reason), out.request_id)


class InProcessBackend:
    """Engines of this process, by model name (see the module docstring)."""

    def __init__(self, *, model: str | None, llm: LLM | None, engine: AsyncEngine | None,
                 engine_kwargs: dict[str, Any]) -> None:
        self._model = model
        self._llm = llm
        self._engine = engine
        self._engine_kwargs = dict(engine_kwargs)
        self._runners: dict[str, _Runner] = {}
        self._default: _Runner | None = None
        self._lock = threading.Lock()
        # Every runner built here, closed by close() or, for a chat model dropped without close(), when
        # this backend is collected: its lease on a shared engine must not outlive it.
        self._built: list[_Runner] = []
        weakref.finalize(self, _close_runners, self._built)

    def default_model_name(self) -> str:
        if self._model:
            return self._model
        source = self._engine if self._engine is not None else self._llm
        if source is not None:
            return source.model_info.model
        return EngineConfig().model  # the default model

    def _runner(self, model: str | None) -> tuple[str, _Runner]:
        with self._lock:
            if self._default is None:
                self._default = self._build_default()
            if not model or model == self.default_model_name():
                return self.default_model_name(), self._default
            if model not in self._runners:
                self._runners[model] = self._build(model)
            return model, self._runners[model]

    def _build_default(self) -> _Runner:
        if self._engine is not None:
            runner: _Runner = _AsyncEngineRunner(self._engine, release=None)
        elif self._llm is not None:
            # The offline LLM is driven as the server drives its engine: an AsyncEngine over the LLM's
            # engine, whose loop this backend starts and stops (the engine itself stays the LLM's).
            engine = self._llm.as_async_engine()
            engine.start()
            runner = _AsyncEngineRunner(engine, release=functools.partial(shutdown_engine, engine))
            self._built.append(runner)
        else:
            return self._build(self.default_model_name())
        # The engine's own model (name or folder) addresses it too.
        info = (self._engine or self._llm).model_info
        for alias in (info.model, info.model_path):
            self._runners.setdefault(alias, runner)
        return runner

    def _build(self, model: str) -> _Runner:
        """A runner on the process's shared engine for this model and these engine settings
        (shared_engines.py): chat models that differ only in call options share one engine."""
        try:
            lease = shared_engines().acquire(EngineConfig(**{**self._engine_kwargs, "model": model}))
        except Exception as exc:
            mapped = from_engine_load_error(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        runner = _AsyncEngineRunner(lease.engine, release=lease.release)
        self._built.append(runner)
        return runner

    def _call(self, messages: list[dict], options: CallOptions) -> _Call:
        model, runner = self._runner(options.model)
        return _Call(runner, model, messages, options)

    async def _acall(self, messages: list[dict], options: CallOptions) -> _Call:
        """_call off the event loop when building it (an engine on first use, or rendering and tokenizing
        a large prompt) takes a while."""
        model = options.model
        builds = self._default is None or (model and model != self.default_model_name() and model not in self._runners)
        if builds or _num_chars(messages) > LARGE_PROMPT_CHARS:
            return await asyncio.to_thread(self._call, messages, options)
        return self._call(messages, options)

    # -- the backend contract ------------------------------------------------------------------
    def complete(self, messages: list[dict], options: CallOptions) -> Completion:
        call = self._call(messages, options)
        last = None
        for last in call.runner.iter_outputs(call.prompt, call.params, options.cache_salt, call.deadline):
            pass
        return call.completion(last)

    async def acomplete(self, messages: list[dict], options: CallOptions) -> Completion:
        call = await self._acall(messages, options)
        last = None
        async for last in call.runner.outputs(call.prompt, call.params, options.cache_salt, call.deadline):
            pass
        return call.completion(last)

    def stream(self, messages: list[dict], options: CallOptions) -> Iterator[Delta | StreamEnd]:
        call = self._call(messages, options)
        outputs = call.runner.iter_outputs(call.prompt, call.params, options.cache_salt, call.deadline)
        try:
            for out in outputs:
                yield from call.deltas(out)
        finally:
            outputs.close()

    async def astream(self, messages: list[dict], options: CallOptions) -> AsyncIterator[Delta | StreamEnd]:
        call = await self._acall(messages, options)
        outputs = call.runner.outputs(call.prompt, call.params, options.cache_salt, call.deadline)
        try:
            async for out in outputs:
                for event in call.deltas(out):
                    yield event
        finally:
            await outputs.aclose()

    def close(self) -> None:
        """Release the engines this backend built or leased (given ones belong to their owner)."""
        with self._lock:
            self._runners.clear()
            self._default = None
        _close_runners(self._built)


def _close_runners(runners: list[_Runner]) -> None:
    while runners:
        runners.pop().close()
