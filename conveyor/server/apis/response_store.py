"""The Responses API's store: finished responses by id, each with the conversation it ends, so that
`previous_response_id` continues it and `GET /v1/responses/{id}` returns it.

In memory, per app, bounded by count and by bytes (--responses-store-max, --responses-store-max-bytes):
the oldest entry goes first. Each entry holds its whole conversation (every earlier input and output
item), so a chain survives the eviction of its ancestors; the byte bound pays for that.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as it was answered
    conversation: list[dict]  # input items of the whole chain, then this response's output items
    num_bytes: int


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Store (or replace) `response` under its id; False when it alone is over the byte bound."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        self.delete(response["id"])
        if size > self.max_bytes:
            return False
        self._entries[response["id"]] = StoredResponse(response, conversation, size)
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.num_bytes -= dropped.num_bytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True
