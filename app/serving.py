"""From an OpenAI request to engine requests and back: sampling params, the chat template, running
the requests (with disconnect -> abort), and the OpenAI response shapes, streamed or whole.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from litestar import Request

from app.errors import OpenAIError, sse_error
from app.metrics import RequestTracker, ServerMetrics
from app.protocol import (
    ChatLogprobs, ChatMessage, ChatTokenLogprob, CompletionLogprobs, PromptTokensDetails, TopLogprob, Usage, encode,
)
from engine.async_engine import AsyncEngine
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tool_calls import ToolChat, ToolRequest
from engine.structured_output import check_structured_outputs, close_json_schema

MAX_N = 128
INT64 = (-(2**63), 2**63 - 1)
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
DONE = b"data: [DONE]\n\n"


# -- sampling parameters -------------------------------------------------------------------
def sampling_params(req: Any, *, max_tokens: int | None, logprobs: int | None, vocab_size: int) -> SamplingParams:
    """The SamplingParams of a completion or chat request (OpenAI defaults; invalid values -> 400)."""
    n = 1 if req.n is None else req.n
    if n > MAX_N:
        raise OpenAIError(400, f"n must be at most {MAX_N}, got {n}.", param="n")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "length_penalty"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            raise OpenAIError(400, f"{name} must be a finite number.", param=name)
    if req.seed is not None and not INT64[0] <= req.seed <= INT64[1]:
        raise OpenAIError(400, "seed must be a 64-bit signed integer.", param="seed")
    logit_bias = None
    if req.logit_bias:
        logit_bias = {}
        for key, bias in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise OpenAIError(400, f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
            if not 0 <= token < vocab_size:
                raise OpenAIError(400, f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size}).",
                                  param="logit_bias")
            if not math.isfinite(bias):
                raise OpenAIError(400, "logit_bias values must be finite.", param="logit_bias")
            logit_bias[token] = bias
    values: dict[str, Any] = {
        "n": n,
        "best_of": req.best_of,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens or 0,
        "logprobs": logprobs,
        "prompt_logprobs": req.prompt_logprobs,
        "ignore_eos": bool(req.ignore_eos),
        "include_stop_str_in_output": bool(req.include_stop_str_in_output),
        "skip_special_tokens": True if req.skip_special_tokens is None else req.skip_special_tokens,
        "spaces_between_special_tokens": (True if req.spaces_between_special_tokens is None
                                          else req.spaces_between_special_tokens),
        "logit_bias": logit_bias,
        "use_beam_search": bool(req.use_beam_search),
        "length_penalty": 1.0 if req.length_penalty is None else req.length_penalty,
        "early_stopping": False if req.early_stopping is None else req.early_stopping,
        "structured_outputs": structured_outputs(req),
    }
    return SamplingParams(**values)  # its own checks raise InvalidRequestError(param=...) -> 400


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The output constraint of a request: OpenAI's `response_format`, vLLM's `structured_outputs`
    or its older `guided_*` fields (at most one of them). A malformed or non-compiling constraint
    is a 400 naming the field it came from."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if req.structured_outputs is not None:
        given = {k: v for k, v in req.structured_outputs.items() if k in _STRUCTURED_KEYS and v is not None}
        found.append(("structured_outputs", _structured("structured_outputs", **given)))
    for name, key in _GUIDED_FIELDS.items():
        if getattr(req, name) is not None:
            found.append((name, _structured(name, **{key: getattr(req, name)})))
    if not found:
        return None
    if len(found) > 1:
        raise OpenAIError(400, f"Give one output constraint, not several ({', '.join(n for n, _ in found)}).",
                          param=found[1][0])
    param, spec = found[0]
    try:
        check_structured_outputs(spec, param=param)  # tokenizer-free compile: fails here, not in the engine
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc), param=param) from None
    return spec


def _structured(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc), param=param) from None


def _response_format(value: Any) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (no constraint), json_object, json_schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        json_schema = value.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema, a JSON Schema "
                              "object.", param="response_format")
        # The output always follows the schema; strict mode (as OpenAI's) also closes every object.
        if json_schema.get("strict") is True:
            schema = close_json_schema(schema)
        return StructuredOutputsParams(json=schema)
    raise OpenAIError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                      "{\"type\": \"json_schema\", \"json_schema\": {...}}.", param="response_format")


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
                    request_id: str, *, priority: int, cache_salt: str | None) -> "Run":
        """Submit every prompt; an admission error (400 ...) aborts the ones already accepted."""
        run = cls(engine)
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                run.streams.append(await engine.submit(prompt, params, rid, priority=priority, cache_salt=cache_salt))
                run.trackers.append(metrics.tracker())
        except BaseException:
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


def finish_reason(output: CompletionOutput) -> str | None:
    if output.finish_reason in ("stop", "length"):
        return output.finish_reason
    return None


def _sorted_top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank if item[1].rank is not None else 1 << 30))
    return [(tid, lp) for tid, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


def _token_text(decode: Callable[[int], str], tid: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else decode(tid)


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int,
                  decode: Callable[[int], str]) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid) or Logprob(float("nan"))
        text = _token_text(decode, tid, chosen)
        top = [TopLogprob(_token_text(decode, t, lp), lp.logprob, list(_token_text(decode, t, lp).encode()))
               for t, lp in _sorted_top(entry, k)]
        content.append(ChatTokenLogprob(text, chosen.logprob, list(text.encode()), top))
    return ChatLogprobs(content=content)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int,
                        decode: Callable[[int], str], offset: int) -> CompletionLogprobs:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid) or Logprob(float("nan"))
        text = _token_text(decode, tid, chosen)
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top = {_token_text(decode, t, lp): lp.logprob for t, lp in _sorted_top(entry, k)}
        top.setdefault(text, chosen.logprob)  # OpenAI: the sampled token is always listed
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, offsets)


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


async def guarded_stream(events: AsyncIterator[bytes], run: Run) -> AsyncGenerator[bytes, None]:
    """The SSE body: events, `[DONE]`, or one error event; the run is aborted however it ends."""
    try:
        async for event in events:
            yield event
        yield DONE
    except Exception as exc:
        yield sse_error(exc)
    finally:
        await run.close()
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
