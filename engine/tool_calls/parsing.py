"""Generated text back into OpenAI-shaped tool calls: whole (parse_tool_calls) or streamed."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.tool_calls.request import CALL_CLOSE, CALL_OPEN, ToolRequest

# -- parsing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One parsed call, OpenAI-shaped by `to_openai()`; `arguments` is JSON text of an object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

@dataclass(frozen=True)
class ParsedMessage:
    """An assistant message: text content (None when it is only tool calls) and its tool calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()

    def finish_reason(self, engine_finish_reason: str | None) -> str | None:
        """OpenAI's finish reason (see `tool_finish_reason`)."""
        return tool_finish_reason(len(self.tool_calls), engine_finish_reason)

    def to_openai(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return message

def tool_finish_reason(num_calls: int, engine_finish_reason: str | None) -> str | None:
    """OpenAI's finish reason of a message with `num_calls` complete tool calls: "tool_calls" when there
    is one, also when max_tokens ended the output after it (a call it cut off is dropped, the complete
    ones stand; clients run calls on "tool_calls"); else the engine's own reason."""
    if num_calls and engine_finish_reason in ("stop", "length"):
        return "tool_calls"
    return engine_finish_reason


class ToolCallStreamParser:
    """Splits generated text, as it streams, into content pieces (str) and complete ToolCalls.

    `feed(delta)` returns what is certain so far; text that might still become "<tool_call>" is held
    back. A block that does not parse as a call of a known tool (never the case under a grammar) is
    content. A call identical (name and arguments) to one already reported is dropped: small models
    repeat themselves, and the engine ends such an output at the repeat. Whitespace next to a call
    block is dropped; other text comes through verbatim, and without callable tools ("none", or no
    request) everything does. `finish()` flushes the rest; a block that max_tokens (or a stop string)
    cut off before its closing tag is dropped, never shown as content.
    """

    def __init__(self, request: ToolRequest | None) -> None:
        self.request = request
        self._active = request is not None and bool(request.callable_tools)
        self._buffer = ""
        self._in_call = False
        self._scan = 0  # inside a block: where to look for the next closing tag
        self._pending_ws = ""  # trailing whitespace of the text so far: dropped if a call follows
        self._after_call = False
        self._seen: set[tuple[str, str]] = set()  # (name, arguments) of the calls reported
        self.num_calls = 0

    def feed(self, delta: str) -> list[str | ToolCall]:
        if not self._active:
            return [delta] if delta else []
        events: list[str | ToolCall] = []
        self._buffer += delta
        while True:
            if not self._in_call:
                start = self._buffer.find(CALL_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, CALL_OPEN)
                    self._text(self._take(len(self._buffer) - keep), events)
                    return events
                self._text(self._take(start), events)
                self._pending_ws = ""
                self._take(len(CALL_OPEN))
                self._in_call = True
            else:
                # The arguments may contain "</tool_call>" inside a JSON string: the block ends at the
                # first closing tag after which the body parses.
                end = self._buffer.find(CALL_CLOSE, self._scan)
                if end < 0:
                    self._scan = max(self._scan, len(self._buffer) - len(CALL_CLOSE) + 1)
                    return events
                call = self._call(self._buffer[:end])
                if call is None:
                    self._scan = end + 1
                    continue
                self._take(end + len(CALL_CLOSE))
                self._in_call, self._scan = False, 0
                if (call.name, call.arguments) not in self._seen:
                    self._seen.add((call.name, call.arguments))
                    self.num_calls += 1
                    events.append(call)
                self._after_call = True

    def finish(self) -> list[str | ToolCall]:
        if not self._active:
            return []
        events = self.feed("")
        rest = self._take(len(self._buffer))
        if not self._in_call:
            self._text(rest, events)
        elif CALL_CLOSE in rest:  # closed but not a call (never under a grammar): the model's text
            self._text(CALL_OPEN + rest, events)
        self._in_call, self._scan = False, 0
        pending, self._pending_ws = self._pending_ws, ""
        self._append(pending, events)
        return events

    def finish_reason(self, engine_finish_reason: str | None) -> str | None:
        """OpenAI's finish reason for what was fed so far (see `tool_finish_reason`)."""
        return tool_finish_reason(self.num_calls, engine_finish_reason)

    def _take(self, n: int) -> str:
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        return taken

    def _text(self, text: str, events: list[str | ToolCall]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        self._append(body, events)

    @staticmethod
    def _append(text: str, events: list[str | ToolCall]) -> None:
        if not text:
            return
        if events and isinstance(events[-1], str):
            events[-1] += text
        else:
            events.append(text)

    def _call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        if self.request is None or self.request.tool(value["name"]) is None:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0

def parse_tool_calls(text: str, request: ToolRequest | None) -> ParsedMessage:
    """Split a whole generated text into content and tool calls (what streaming yields, joined)."""
    parser = ToolCallStreamParser(request)
    events = parser.feed(text) + parser.finish()
    calls = tuple(e for e in events if isinstance(e, ToolCall))
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedMessage(content if content or not calls else None, calls)
