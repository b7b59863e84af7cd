"""Prefix-cache page events: what a cache-aware router needs to know about one replica's cache.

A router that sends a session's next turn to the replica already holding its
prefix must know which full pages each replica has indexed. The cache emits
two plain records for that, in the order things happened:

* `PagesStored`: a run of consecutive pages of one prompt chain became
  indexed (each page's chained hash, and the tokens of the run, `page_size`
  per page; `parent_hash` is the hash of the page before the run, None at
  the start of a prompt);
* `PagesRemoved`: indexed pages were evicted for reuse.

Recording is off by default (the log costs nothing then) and is switched on
by the process that forwards the records (`engine/core_process.py`).
Consumers drain the log after each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class PagesStored:
    parent_hash: bytes | None
    page_hashes: list[bytes]
    token_ids: list[int]  # len(page_hashes) * page_size tokens


@dataclass(slots=True, frozen=True)
class PagesRemoved:
    page_hashes: list[bytes]


KVEvent = PagesStored | PagesRemoved


class KVEventLog:
    """Records of index changes since the last `drain()`, kept only while `enabled`."""

    __slots__ = ("enabled", "_events")

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[KVEvent] = []

    def stored(self, parent_hash: bytes | None, page_hashes: list[bytes], token_ids: Sequence[int]) -> None:
        if self.enabled and page_hashes:
            self._events.append(PagesStored(parent_hash, page_hashes, list(token_ids)))

    def removed(self, page_hash: bytes) -> None:
        if not self.enabled:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, PagesRemoved):  # one allocation evicts many pages: one record
            last.page_hashes.append(page_hash)
        else:
            self._events.append(PagesRemoved([page_hash]))

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
