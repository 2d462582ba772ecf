"""From an OpenAI request to engine requests and back: sampling params, the chat template, running
the requests (with disconnect -> abort), and the OpenAI response shapes, streamed or whole.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from app.errors import OpenAIError, sse_error
from app.metrics import RequestTracker, ServerMetrics
from app.protocol import (
    ChatLogprobs, ChatMessage, ChatTokenLogprob, CompletionLogprobs, PromptTokensDetails, TopLogprob, Usage, encode,
)
from engine.async_engine import AsyncEngine
from engine.errors import EngineOverloadedError
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine import openai_compat
from engine.sampling_params import SamplingParams
from engine.tool_calls import PreparedChat, ToolChat, ToolRequest

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
DONE = b"data: [DONE]\n\n"


# -- sampling parameters -------------------------------------------------------------------
def sampling_params(req: Any, *, max_tokens: int | None, logprobs: int | None, vocab_size: int) -> SamplingParams:
    """The SamplingParams of a completion or chat request (engine/openai_compat.py; invalid values -> 400)."""
    return openai_compat.sampling_params(msgspec.structs.asdict(req), max_tokens=max_tokens, logprobs=logprobs,
                                         vocab_size=vocab_size)


def completion_sampling_params(req: Any, *, max_tokens: int, vocab_size: int) -> SamplingParams:
    """/v1/completions' SamplingParams: echo with logprobs scores the prompt, max_tokens may be 0."""
    return openai_compat.completion_sampling_params(msgspec.structs.asdict(req), max_tokens=max_tokens,
                                                    vocab_size=vocab_size)


# -- prompts -------------------------------------------------------------------------------
def completion_prompts(prompt: Any) -> list[str | dict]:
    """`prompt` as a list of engine prompts: a string, a list of strings, a token list or a list of them."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise OpenAIError(400, "prompt token lists must not be empty.", param="prompt")
        return [{"prompt_token_ids": p} for p in prompt]
    raise OpenAIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                      "token-id lists (not a mix).", param="prompt")


def _message_text(message: ChatMessage, i: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("text", "input_text") or part.text is None:
            raise OpenAIError(400, f"Content parts of type {part.type!r} are not supported; only text parts are.",
                              param=f"messages[{i}].content[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def chat_conversation(messages: Sequence[ChatMessage]) -> list[dict]:
    """OpenAI messages as the plain dicts chat templates expect (content flattened to text)."""
    if not messages:
        raise OpenAIError(400, "messages must contain at least one message.", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise OpenAIError(400, f"Invalid role {message.role!r}; expected one of {sorted(CHAT_ROLES)}.",
                              param=f"messages[{i}].role")
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                 "content": _message_text(message, i)}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        conversation.append(entry)
    return conversation


def render_chat(tool_chat: ToolChat, conversation: list[dict], *, add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict | None, tools: ToolRequest | None = None
                ) -> list[int]:
    """Apply the model's chat template (engine/tool_calls.py: tool calls, tool results and `tools` are
    rendered the way /v1/chat/completions renders them); token ids without extra special tokens."""
    return tool_chat.render(conversation, tools, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      chat_template_kwargs=template_kwargs)


# Rendering + tokenizing a conversation longer than this takes long enough to leave the event loop.
LARGE_PROMPT_CHARS = 64 * 1024


async def prepare_chat(tool_chat: ToolChat, conversation: list[dict], *args: Any, **kwargs: Any) -> PreparedChat:
    """`tool_chat.prepare(conversation, *args, **kwargs)` (template, tools, grammar), in a worker
    thread when the conversation is large so the event loop stays free meanwhile."""
    if sum(len(m["content"]) for m in conversation) > LARGE_PROMPT_CHARS:
        return await asyncio.to_thread(tool_chat.prepare, conversation, *args, **kwargs)
    return tool_chat.prepare(conversation, *args, **kwargs)


# -- running -------------------------------------------------------------------------------
@dataclass(eq=False)
class Run:
    """The engine requests of one API call (one per prompt) and their latency trackers."""

    engine: AsyncEngine
    streams: list[AsyncGenerator[RequestOutput, None]] = field(default_factory=list)
    trackers: list[RequestTracker] = field(default_factory=list)
    _pumps: list[asyncio.Future] = field(default_factory=list)

    @classmethod
    async def start(cls, engine: AsyncEngine, metrics: ServerMetrics, prompts: list, params: SamplingParams,
                    request_id: str, *, priority: int, cache_salt: str | None,
                    max_queued: int | None = None) -> "Run":
        """Submit every prompt; an admission error (400 ...) aborts the ones already accepted. `max_queued`
        (--max-queued-requests): the engine refuses a prompt when that many requests already wait
        (EngineOverloadedError, counted as shed; the whole call is refused)."""
        run = cls(engine)
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                run.streams.append(await engine.submit(prompt, params, rid, priority=priority, cache_salt=cache_salt,
                                                       max_queued=max_queued))
                run.trackers.append(metrics.tracker(params.n, params.max_tokens))
        except BaseException as exc:
            if isinstance(exc, EngineOverloadedError):
                metrics.shed.inc()
            await run.close()
            raise
        return run

    async def close(self) -> None:
        """Abort whatever has not finished (idempotent)."""
        for pump in self._pumps:
            pump.cancel()  # a cancelled pump aborts its engine request through its stream's finally
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)
        for stream in self.streams:
            try:
                await stream.aclose()
            except RuntimeError:  # still running in a pump being cancelled: that closes it
                pass

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as they come, all prompts interleaved."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                self.trackers[0].observe(out)
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        finished = object()

        async def pump(i: int) -> None:
            try:
                async for out in self.streams[i]:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, finished))
            except Exception as exc:
                queue.put_nowait((i, exc))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self.streams))]
        self._pumps.extend(tasks)
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is finished:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self.trackers[i].observe(item)
                yield i, item
        finally:
            for task in tasks:  # cancelling a pump aborts its engine request (its stream's finally)
                task.cancel()

    async def final_outputs(self, request: Request | None) -> list[RequestOutput]:
        """Run to completion; a client that disconnects first cancels (and so aborts) the run."""
        finals: list[RequestOutput | None] = [None] * len(self.streams)

        async def consume() -> None:
            async for i, out in self.outputs():
                finals[i] = out

        work = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request)) if request is not None else None
        try:
            waiting = {work} if watcher is None else {work, watcher}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left
                work.cancel()
                raise OpenAIError(499, "The client closed the request.", type="client_closed_request")
            work.result()
        finally:
            work.cancel()
            if watcher is not None:
                watcher.cancel()
        if any(out is None or not out.finished for out in finals):
            raise OpenAIError(503, "The request was aborted before it finished.", headers={"Retry-After": "1"})
        return finals  # type: ignore[return-value]

    async def final_choice(self, request: Request | None) -> tuple[RequestOutput, CompletionOutput]:
        """One prompt, one choice: run it to completion, close the run, and return its output and that choice
        (an aborted choice is a 503)."""
        try:
            [out] = await self.final_outputs(request)
        finally:
            await self.close()
        check_aborted(out.outputs[0])
        return out, out.outputs[0]


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- response pieces -----------------------------------------------------------------------
def usage(finals: Sequence[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


finish_reason = openai_compat.finish_reason


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int,
                  decode: Callable[[int], str]) -> ChatLogprobs:
    content = openai_compat.chat_logprobs(token_ids, entries, k, decode)
    return ChatLogprobs(content=[
        ChatTokenLogprob(c["token"], c["logprob"], c["bytes"], [TopLogprob(**t) for t in c["top_logprobs"]])
        for c in content
    ])


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int,
                        decode: Callable[[int], str], offset: int) -> CompletionLogprobs:
    lp = openai_compat.completion_logprobs(token_ids, entries, k, decode, offset)
    return CompletionLogprobs(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"])


@dataclass(eq=False)
class ChoiceCursor:
    """How much of one choice a stream has sent: text, tokens, and whether it finished."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    done: bool = False

    def advance(self, output: CompletionOutput) -> tuple[str, int, int]:
        """(new text, first new token, end of new tokens) since the last call."""
        text = output.text[self.text_len:] if len(output.text) > self.text_len else ""
        self.text_len = max(self.text_len, len(output.text))
        start, end = self.num_tokens, len(output.token_ids)
        self.num_tokens = end
        return text, start, end


def sse(payload: Any) -> bytes:
    return b"data: " + encode(payload) + b"\n\n"


async def guarded_stream(events: AsyncIterator[bytes], run: Run, *, done: bytes | None = DONE,
                         error: Callable[[BaseException], bytes] = sse_error) -> AsyncGenerator[bytes, None]:
    """The SSE body: events, `done` (`[DONE]`; None: nothing), or one `error(exc)` event; the run is
    aborted however it ends."""
    try:
        async for event in events:
            yield event
        if done is not None:
            yield done
    except Exception as exc:
        yield error(exc)
    finally:
        await run.close()
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def sse_response(body: AsyncGenerator[bytes, None], run: Run) -> Stream:
    async def cleanup() -> None:  # runs after the response, also after a disconnect
        await body.aclose()
        await run.close()

    return Stream(body, media_type="text/event-stream", status_code=200,
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                  background=BackgroundTask(cleanup))


def json_response(payload: Any) -> Response:
    return Response(content=encode(payload), media_type="application/json", status_code=200)


def check_aborted(output: CompletionOutput) -> None:
    if output.finish_reason == "abort":
        raise OpenAIError(503, "The request was aborted by the server.", headers={"Retry-After": "1"})
