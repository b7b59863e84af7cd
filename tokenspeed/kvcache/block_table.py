"""`BlockTable`: the linear ownership handle of one request's KV pages.

Page `i` of the table holds the K/V of token positions `i*page_size ...`.
Holding a page id in a table IS holding one reference to it: pages enter a
table only through the pool (`allocate` or a prefix-cache hit) and
leave it only through `release()`. Python cannot forbid aliasing at compile
time, so ownership transfer is explicit and checked at run time: `move()`
hands the pages to a new handle and consumes the old one; any later use of a
consumed handle raises `StaleBlockTable` instead of double-freeing pages or
writing KV into pages someone else now owns.

The table also remembers the chained hashes of its pages already published to
the prefix index, so publishing after each step only hashes the new pages.
"""

from __future__ import annotations

from tokenspeed.kvcache.errors import StaleBlockTable
from tokenspeed.kvcache.page_pool import PagePool


class BlockTable:
    __slots__ = ("_pool", "_pages", "_hashes", "_consumed_by", "__weakref__")

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._pages: list[int] = []
        self._hashes: list[bytes] = []  # hashes of pages[0 : len(hashes)], published
        self._consumed_by: str | None = None
        pool.register(self)

    def __repr__(self) -> str:
        if self._consumed_by is not None:
            return f"BlockTable(<{self._consumed_by}>)"
        return f"BlockTable({self._pages})"

    def ensure_live(self) -> None:
        """Raise `StaleBlockTable` if this handle was moved or released."""
        if self._consumed_by is not None:
            raise StaleBlockTable(
                f"this BlockTable was consumed by {self._consumed_by}(); use the handle it was moved "
                "into (its pages are no longer owned through this one)"
            )

    # ---- reading -------------------------------------------------------------

    @property
    def is_consumed(self) -> bool:
        return self._consumed_by is not None

    @property
    def pages(self) -> list[int]:
        """A copy of the page ids, in position order."""
        self.ensure_live()
        return list(self._pages)

    def pages_from(self, index: int) -> list[int]:
        """A copy of the page ids from `index` on (what a table gained since it had `index` pages)."""
        self.ensure_live()
        return self._pages[index:]

    def __len__(self) -> int:
        self.ensure_live()
        return len(self._pages)

    def page_at(self, index: int) -> int:
        self.ensure_live()
        return self._pages[index]

    @property
    def num_published(self) -> int:
        """How many leading pages were already hashed into the prefix index."""
        self.ensure_live()
        return len(self._hashes)

    def published_hashes(self) -> list[bytes]:
        """A copy of the chained hashes of the leading published pages."""
        self.ensure_live()
        return list(self._hashes)

    @property
    def last_hash(self) -> bytes | None:
        self.ensure_live()
        return self._hashes[-1] if self._hashes else None

    def held_pages(self) -> list[int]:
        """Pages this handle references (empty once consumed); for accounting checks."""
        return list(self._pages)

    # ---- ownership -------------------------------------------------------------

    def move(self) -> BlockTable:
        """A new handle owning this table's pages; this one is consumed."""
        self.ensure_live()
        moved = BlockTable(self._pool)
        moved._pages, self._pages = self._pages, []
        moved._hashes, self._hashes = self._hashes, []
        self._consume("move")
        return moved

    def truncate(self, num_pages: int) -> None:
        """Drop the references to the pages past the first `num_pages` (last first).

        Speculative decoding frees the pages that held only rejected draft positions this way.
        A published page is never dropped: its tokens are computed, so it cannot hold a rejection.
        """
        self.ensure_live()
        if num_pages < len(self._hashes):
            raise AssertionError(f"truncating to {num_pages} pages would drop published page {len(self._hashes) - 1}")
        dropped, self._pages = self._pages[num_pages:], self._pages[:num_pages]
        for page in reversed(dropped):
            self._pool.decref(page)

    def release(self) -> None:
        """Drop every reference, last page first (the LRU then evicts leaves before roots)."""
        self.ensure_live()
        pages, self._pages = self._pages, []
        self._hashes = []
        self._consume("release")
        for page in reversed(pages):
            self._pool.decref(page)

    # ---- used by KVCache ------------------------------------------------------

    def _adopt(self, pages: list[int]) -> None:
        """Append pages whose references the caller just took from the pool."""
        self.ensure_live()
        self._pages.extend(pages)

    def _acquire(self, page: int) -> None:
        """Take a new reference to a cached page and append it."""
        self.ensure_live()
        self._pool.incref(page)
        self._pages.append(page)

    def _record_hash(self, page_hash: bytes) -> None:
        self.ensure_live()
        if len(self._hashes) >= len(self._pages):
            raise AssertionError("recording a hash for a page the table does not hold")
        self._hashes.append(page_hash)

    def _consume(self, how: str) -> None:
        self._consumed_by = how
        self._pool.unregister(self)
