"""Typed errors of the KV page pool.

The scheduler must tell "no room right now" (`OutOfPages`: preempt or wait)
from a bookkeeping bug (`StaleBlockTable`, `PageRefError`: a handle used after
it gave its pages away, a page released twice). Bugs raise loudly instead of
corrupting another request's KV cache silently.
"""

from __future__ import annotations

from tokenspeed.errors import TokenSpeedError


class KVCacheError(TokenSpeedError):
    """Base class of every error raised by `tokenspeed.kvcache`."""


class OutOfPages(KVCacheError):
    """An allocation asked for more pages than are free or evictable; nothing was allocated."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(
            f"cannot allocate {requested} KV pages: only {available} are free or evictable "
            "(allocation is all-or-nothing, nothing was taken)"
        )
        self.requested = requested
        self.available = available


class StaleBlockTable(KVCacheError, RuntimeError):
    """A `BlockTable` was used after `move()` or `release()` consumed it."""


class PageRefError(KVCacheError, RuntimeError):
    """A page reference was dropped twice, or taken on a page nobody may reference."""
