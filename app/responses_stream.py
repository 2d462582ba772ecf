"""`stream: true` on /v1/responses: the Responses API's server-sent events, each `event: <type>` plus a
JSON `data` with the same `type` and a `sequence_number` counting from 0.

    response.created, response.in_progress
    per text run:  response.output_item.added (message), response.content_part.added,
                   response.output_text.delta ..., response.output_text.done, response.content_part.done,
                   response.output_item.done
    per tool call: response.output_item.added (function_call), response.function_call_arguments.delta,
                   response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it off)

A call arrives whole (the tool-call parser releases it once its block closes), so its arguments come
in one delta. There is no `[DONE]` line (OpenAI sends none on this API); an error after the stream
began is one `error` event, and the stream ends.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from app.errors import OpenAIError, from_exception
from app.protocol import encode
from app.responses_output import call_item, finished_response, message_item, response_usage, status_of
from app.responses_protocol import OutputItem, OutputMessage, OutputText, ResponseObject
from app.serving import ChoiceCursor, Run, check_aborted, finish_reason
from engine.tool_calls import PreparedChat, ToolCall


@dataclass(eq=False)
class EventWriter:
    """Numbers and frames the events of one stream."""

    sequence_number: int = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode(payload) + b"\n\n"

    def error(self, exc: BaseException) -> bytes:
        error = from_exception(exc)
        return self("error", code=error.code, message=error.message, param=error.param)


@dataclass(eq=False)
class StreamedOutput:
    """The output items sent so far; at most one message item is open (receiving text) at a time."""

    event: EventWriter
    items: list[OutputItem] = field(default_factory=list)
    _open: OutputMessage | None = None

    def text(self, delta: str) -> list[bytes]:
        events = []
        if self._open is None:
            self._open = message_item("", "in_progress")
            part = self._open.content.pop()
            events.append(self._added(self._open))  # framed now: the added item has no parts yet
            self._open.content.append(part)
            events.append(self._part("response.content_part.added", part))
        if delta:
            self._open.content[0].text += delta
            events.append(self.event("response.output_text.delta", item_id=self._open.id,
                                     output_index=self._index(self._open), content_index=0, delta=delta,
                                     logprobs=[]))
        return events

    def call(self, call: ToolCall) -> list[bytes]:
        events = self.close("completed")
        item = call_item(call, "in_progress", arguments="")
        events.append(self._added(item))
        where = {"item_id": item.id, "output_index": self._index(item)}
        events.append(self.event("response.function_call_arguments.delta", **where, delta=call.arguments))
        events.append(self.event("response.function_call_arguments.done", **where, arguments=call.arguments))
        item.arguments, item.status = call.arguments, "completed"
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return events

    def close(self, status: str) -> list[bytes]:
        """End the open message item (if any) with `status`."""
        message, self._open = self._open, None
        if message is None:
            return []
        part = message.content[0]
        message.status = status
        where = {"item_id": message.id, "output_index": self._index(message)}
        return [
            self.event("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[]),
            self._part("response.content_part.done", part, message),
            self.event("response.output_item.done", output_index=where["output_index"], item=message),
        ]

    def _added(self, item: OutputItem) -> bytes:
        self.items.append(item)
        return self.event("response.output_item.added", output_index=self._index(item), item=item)

    def _part(self, kind: str, part: OutputText, message: OutputMessage | None = None) -> bytes:
        message = message or self._open
        return self.event(kind, item_id=message.id, output_index=self._index(message), content_index=0, part=part)

    def _index(self, item: OutputItem) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)


async def response_events(run: Run, base: ResponseObject, prepared: PreparedChat, event: EventWriter,
                          on_finished: Callable[[ResponseObject], None]) -> AsyncIterator[bytes]:
    """The events of one streamed response; `on_finished(response)` runs before the final event."""
    yield event("response.created", response=base)
    yield event("response.in_progress", response=base)
    output = StreamedOutput(event)
    cursor, parser = ChoiceCursor(), prepared.stream_parser()
    reason, latest = None, None
    async for _, out in run.outputs():
        latest, choice = out, out.outputs[0]
        check_aborted(choice)
        text, _, _ = cursor.advance(choice)
        reason = finish_reason(choice)
        for piece in parser.feed(text) + (parser.finish() if reason is not None else []):
            for frame in (output.call(piece) if isinstance(piece, ToolCall) else output.text(piece)):
                yield frame
        if reason is not None:
            break
    if latest is None or reason is None:
        raise OpenAIError(503, "The request was aborted before it finished.")
    status, _ = status_of(reason)
    for frame in output.close(status):
        yield frame
    if not output.items:  # nothing generated: still one (empty) message, as the non-streamed response has
        for frame in output.text("") + output.close(status):
            yield frame
    final = finished_response(base, output.items, reason, response_usage(latest))
    on_finished(final)
    yield event(f"response.{final.status}", response=final)
