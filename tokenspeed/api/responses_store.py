"""Responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory, least recently used out.

The store is bounded by a count (`--max-stored-responses`): an agent only
ever continues from its latest response, so an old one can go. A stored
response keeps only what its own turn added (its input items and output
items) and a reference to its predecessor, so a session of k turns costs
O(k) items, not O(k²); an evicted response that a stored one continues
stays reachable through it (it can no longer be fetched or continued by
id). Everything runs on the event loop: no locking.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenspeed.api.protocol.responses import InputItem


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as `GET` returns it
    items: list[InputItem]  # this turn's input items, then its output items
    previous: StoredResponse | None

    def history(self) -> list[InputItem]:
        """Every item of the conversation up to and including this response, oldest first."""
        turns: list[list[InputItem]] = []
        record: StoredResponse | None = self
        while record is not None:
            turns.append(record.items)
            record = record.previous
        return [item for turn in reversed(turns) for item in turn]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # 0: nothing is stored
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, response_id: str) -> StoredResponse | None:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def put(self, response_id: str, record: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._records[response_id] = record
        self._records.move_to_end(response_id)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._records.pop(response_id, None) is not None
