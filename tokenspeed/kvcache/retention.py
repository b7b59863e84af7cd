"""`RetentionQueue`: evictable pages a session asked to keep, earliest expiry first.

An agent's turn ends, the agent runs a tool for seconds to minutes, then sends
a prompt that repeats ~96% of the last one. Plain LRU evicts that prefix as
soon as other sessions need room. Retention gives the finished turn's pages a
soft priority until an expiry (`session_ttl`): the pool evicts every
unprotected cached page first, then retained ones in expiry order (the one
whose session is least likely to come back first), and a retained page whose
expiry passed is just a cold cached page again. Nothing here can refuse an
allocation: when only retained pages are left, they are evicted.

A binary heap with lazy deletion keeps eviction O(log n) while expiries are
extended (a session's next turn refreshes them) and pages leave the queue
when they are hit: an entry is live only while `_until[page]` still equals it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator


class RetentionQueue:
    __slots__ = ("_until", "_heap")

    def __init__(self) -> None:
        self._until: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._until)

    def __contains__(self, page: int) -> bool:
        return page in self._until

    def __iter__(self) -> Iterator[int]:
        """Pages, earliest expiry first (ties: lower page id)."""
        return iter(sorted(self._until, key=lambda page: (self._until[page], page)))

    def until(self, page: int) -> float:
        return self._until[page]

    def add(self, page: int, until: float) -> None:
        """Queue `page` (or move it) to expire at `until`."""
        self._until[page] = until
        heapq.heappush(self._heap, (until, page))
        if len(self._heap) > 2 * len(self._until) + 64:
            self._heap = [(t, p) for p, t in self._until.items()]
            heapq.heapify(self._heap)

    def remove(self, page: int) -> None:
        del self._until[page]  # its heap entry goes stale

    def pop_expired(self, now: float) -> list[int]:
        """Remove and return every page whose expiry is `<= now`, earliest first."""
        expired: list[int] = []
        while self._heap and self._heap[0][0] <= now:
            until, page = heapq.heappop(self._heap)
            if self._until.get(page) == until:
                del self._until[page]
                expired.append(page)
        return expired

    def pop_first(self, eligible: Callable[[int], bool], before: float) -> int | None:
        """Remove and return the earliest-expiring eligible page expiring before `before`, if any."""
        skipped: list[tuple[float, int]] = []
        found: int | None = None
        while self._heap and self._heap[0][0] < before:
            entry = heapq.heappop(self._heap)
            until, page = entry
            if self._until.get(page) != until:
                continue  # stale
            if eligible(page):
                del self._until[page]
                found = page
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def check_invariants(self) -> None:
        live = {(until, page) for page, until in self._until.items()}
        assert live <= set(self._heap), "a retained page has no heap entry"
