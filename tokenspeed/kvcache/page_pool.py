"""`PagePool`: the fixed set of device KV pages and who may reuse them.

Every page is in exactly one of three places:

* free list: holds nothing worth keeping; handed out first;
* referenced (refcount > 0): some `BlockTable` reads or writes it; never reused;
* LRU of cached pages: unreferenced, but the prefix index still maps a hash to
  it, so a later request with the same prefix can pick it up without
  recomputing. Allocation evicts from here (oldest release first) only when
  the free list is empty, and tells the index to forget the page.

Keeping cached pages out of the free list is what turns finished agent turns
into prefix hits on the next turn, while the LRU fallback guarantees the pool
can always satisfy an allocation that fits in `free + cached` pages.

The pool also keeps a weak registry of live `BlockTable`s so that
`check_invariants` can prove each refcount equals the number of handles
holding the page: a handle dropped without `release()` shows up as a leak.
"""

from __future__ import annotations

import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenspeed.kvcache.errors import OutOfPages, PageRefError

if TYPE_CHECKING:
    from tokenspeed.kvcache.block_table import BlockTable


class PagePool:
    __slots__ = (
        "num_pages",
        "page_size",
        "_refcount",
        "_cached",
        "_free",
        "_lru",
        "_num_referenced",
        "_on_evict",
        "_holders",
    )

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}.")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}.")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcount = [0] * num_pages
        # True while the prefix index maps some hash to the page.
        self._cached = [False] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()  # first = evicted first
        self._num_referenced = 0
        self._on_evict: Callable[[int], None] | None = None
        self._holders: weakref.WeakSet[BlockTable] = weakref.WeakSet()

    def __getstate__(self) -> dict[str, object]:
        """Snapshots (copy.deepcopy, pickle) must register the copied handles, not the originals."""
        state: dict[str, object] = {name: getattr(self, name) for name in self.__slots__}
        state["_holders"] = list(self._holders)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            if name != "_holders":
                object.__setattr__(self, name, value)
        holders = state["_holders"]
        assert isinstance(holders, list)
        self._holders = weakref.WeakSet(holders)

    # ---- counts -------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_referenced(self) -> int:
        return self._num_referenced

    @property
    def num_cached_unreferenced(self) -> int:
        return len(self._lru)

    @property
    def num_allocatable(self) -> int:
        return len(self._free) + len(self._lru)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return self._cached[page]

    def eviction_order(self) -> list[int]:
        """Cached unreferenced pages, next to be evicted first."""
        return list(self._lru)

    # ---- wiring for the prefix index and handles -----------------------------

    def set_evict_hook(self, hook: Callable[[int], None]) -> None:
        """`hook(page)` runs when a cached page is evicted for reuse (the index forgets it)."""
        self._on_evict = hook

    def mark_cached(self, page: int) -> None:
        """The prefix index now maps a hash to `page` (which a handle references)."""
        if self._refcount[page] <= 0:
            raise PageRefError(f"page {page} is not referenced; only computed pages can be indexed")
        self._cached[page] = True

    def register(self, table: BlockTable) -> None:
        self._holders.add(table)

    def unregister(self, table: BlockTable) -> None:
        self._holders.discard(table)

    def live_holders(self) -> list[BlockTable]:
        return list(self._holders)

    # ---- references ------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """`n` pages with refcount 1: free pages first, then evicted cached ones. All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n}).")
        available = len(self._free) + len(self._lru)
        if n > available:
            raise OutOfPages(n, available)
        pages: list[int] = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._lru.popitem(last=False)
                self._cached[page] = False
                if self._on_evict is not None:
                    self._on_evict(page)
            self._refcount[page] = 1
            pages.append(page)
        self._num_referenced += n
        return pages

    def incref(self, page: int) -> None:
        """Take one more reference: a prefix-cache hit (possibly on a page another request holds)."""
        count = self._refcount[page]
        if count == 0:
            if not self._cached[page]:
                raise PageRefError(f"page {page} is free; take new pages with allocate()")
            del self._lru[page]  # cache hit on an unreferenced page: no longer evictable
            self._num_referenced += 1
        self._refcount[page] = count + 1

    def decref(self, page: int) -> None:
        """Drop one reference; the last one sends the page to the LRU (if cached) or the free list."""
        count = self._refcount[page]
        if count <= 0:
            raise PageRefError(f"page {page} released more times than it was acquired")
        self._refcount[page] = count - 1
        if count == 1:
            self._num_referenced -= 1
            if self._cached[page]:
                self._lru[page] = None  # most recently released: evicted last
            else:
                self._free.append(page)

    # ---- checking ----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's books do not balance."""
        total = self.num_pages
        free = set(self._free)
        lru = set(self._lru)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & lru, f"pages both free and cached: {sorted(free & lru)}"
        referenced = {p for p in range(total) if self._refcount[p] > 0}
        negative = [p for p in range(total) if self._refcount[p] < 0]
        assert not negative, f"negative refcounts on pages {negative}"
        assert not referenced & free, f"pages both free and referenced: {sorted(referenced & free)}"
        assert not referenced & lru, f"pages both cached-unreferenced and referenced: {sorted(referenced & lru)}"
        assert len(referenced) == self._num_referenced, "referenced-page counter is out of sync"
        assert len(free) + len(referenced) + len(lru) == total, (
            f"free {len(free)} + referenced {len(referenced)} + cached {len(lru)} != total {total}"
        )
        for page in free:
            assert not self._cached[page], f"free page {page} is still in the prefix index"
        for page in lru:
            assert self._cached[page], f"LRU page {page} is not in the prefix index"
        held: Counter[int] = Counter()
        for table in self._holders:
            held.update(table.held_pages())
        for page in range(total):
            assert held[page] == self._refcount[page], (
                f"page {page} has refcount {self._refcount[page]} but {held[page]} live BlockTables "
                "hold it (a handle was dropped without release(), or a reference was taken outside one)"
            )
