"""The responses a server keeps for `previous_response_id` and `GET /v1/responses/{id}`: the most recently used ones,
bounded by count and by size, in memory."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from basert.server.errors import ApiError
from basert.server.logs import printable

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass(slots=True)
class StoredResponse:
    """A response object and the conversation after it, as chat messages (without the request's instructions,
    which a follow-up does not inherit)."""

    body: dict
    messages: list[dict]
    size: int = 0


class ResponseStore:
    """Least-recently-used responses by id; adding one beyond the count or size limit evicts the oldest."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict, messages: list[dict]) -> None:
        """Keep `body` (a response object) with the conversation it ends."""
        self.delete(body["id"])
        entry = StoredResponse(body, messages, len(json.dumps([body, messages], ensure_ascii=False)))
        self._entries[body["id"]] = entry
        self.total_bytes += entry.size
        while self._entries and (len(self._entries) > self.max_responses or self.total_bytes > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self.total_bytes -= evicted.size

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response (now the most recently used), or a 404 naming `param`."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise ApiError(404, f"response {printable(response_id, 128)!r} not found (never stored, stored with "
                           "store=false, deleted, or evicted)", type="not_found_error", code="response_not_found",
                           param=param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.total_bytes -= entry.size
        return True
