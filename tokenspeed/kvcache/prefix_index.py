"""`PrefixIndex`: chained hashes of full pages -> the page holding that KV.

A page's hash covers its parent page's hash and its own token ids, so one
lookup per page walks a prompt from the root and stops at the first page
nobody computed: equal hashes mean equal whole prefixes, not just equal pages
(the KV of a token depends on every token before it). Only FULL pages are
hashed: a partial page is still being written by its owner.

blake2b with a 16-byte digest over the tokens as signed 64-bit integers makes
an accidental collision (which would serve another prompt's KV) practically
impossible, unlike Python's `hash()`.

When two requests compute the same page concurrently, the first published
mapping wins and the second page stays unindexed (freed normally on release),
so a hash never points at two pages and the index never has to pick.

The same class indexes every tier that holds pages by content (device pages
and host slots alike), so one walk of a prompt's chained hashes finds each
page wherever it lives. `on_evict(page_hash, protected)` lets the owner count
what an eviction cost (a retained page, a page no lower tier holds).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from hashlib import blake2b

from tokenspeed.kvcache.events import KVEventLog
from tokenspeed.kvcache.page_pool import PagePool

_ROOT = b"\x00"
_CHILD = b"\x01"


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of one full page given its parent page's hash (None for the first page)."""
    digest = blake2b(digest_size=16)
    if parent is None:
        digest.update(_ROOT)
    else:
        digest.update(_CHILD)
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class PrefixIndex:
    __slots__ = ("_pool", "_page_of", "_hash_of", "_on_evict", "events")

    def __init__(self, pool: PagePool, on_evict: Callable[[bytes, bool], None] | None = None) -> None:
        self._pool = pool
        self.events = KVEventLog()  # stored/removed records for a cache-aware router (off by default)
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._on_evict = on_evict
        pool.set_evict_hook(self._evicted)

    def __len__(self) -> int:
        return len(self._page_of)

    def lookup(self, page_hash: bytes) -> int | None:
        return self._page_of.get(page_hash)

    def hash_of(self, page: int) -> bytes | None:
        """The hash `page` is indexed under (None: not indexed)."""
        return self._hash_of.get(page)

    def insert(self, page_hash: bytes, page: int) -> bool | None:
        """Map `page_hash` to `page`: True if newly mapped, None if it already was, False (and no
        change) if another page already has it."""
        existing = self._page_of.get(page_hash)
        if existing is not None:
            return None if existing == page else False
        if page in self._hash_of:
            # A page's tokens are fixed once it is full, so it has one hash for life.
            raise AssertionError(f"page {page} is already indexed under another hash")
        self._pool.mark_cached(page)
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        return True

    def discard(self, page: int) -> None:
        """Forget an unreferenced page whose content never landed (a failed load): it is not reused as a hit."""
        self._pool.unmark_cached(page)
        self._forget(page)

    def _evicted(self, page: int, protected: bool) -> None:
        page_hash = self._forget(page)
        if self._on_evict is not None:
            self._on_evict(page_hash, protected)

    def _forget(self, page: int) -> bytes:
        page_hash = self._hash_of.pop(page)
        del self._page_of[page_hash]
        self.events.removed(page_hash)
        return page_hash

    def check_invariants(self) -> None:
        assert len(self._page_of) == len(self._hash_of), "prefix index maps are out of sync"
        for page_hash, page in self._page_of.items():
            assert self._hash_of.get(page) == page_hash, f"page {page} maps back to another hash"
            assert self._pool.is_cached(page), f"indexed page {page} is not marked cached in the pool"
        cached = sum(1 for p in range(self._pool.num_pages) if self._pool.is_cached(p))
        assert cached == len(self._page_of), "pool marks pages cached that the index does not hold"
