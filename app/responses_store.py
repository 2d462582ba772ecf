"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: a bounded LRU in this
process's memory. Nothing is persisted or shared: a restart, another replica or an evicted entry
makes the id unknown (404), and the client must resend the history in `input` instead."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from app.responses_protocol import ResponseObject

DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    # The conversation a continuation starts from: previous turns, this input and this output, as
    # chat messages (without this response's instructions, which OpenAI does not carry over).
    messages: tuple[dict[str, Any], ...]


class ResponseStore:
    """At most `capacity` responses, least recently used evicted first; 0 keeps none. Used from the
    server's event loop only, so it takes no lock."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if capacity < 0:
            raise ValueError(f"the response store capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, messages: list[dict[str, Any]]) -> None:
        if self.capacity == 0:
            return
        self._entries[response.id] = StoredResponse(response, tuple(messages))
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
