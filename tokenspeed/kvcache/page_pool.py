"""`PagePool`: a fixed set of KV pages (device pages, or host slots) and who may reuse them.

Every page is in exactly one of four places:

* free list: holds nothing worth keeping; handed out first;
* referenced (refcount > 0): some `BlockTable` reads or writes it; never reused;
* cached: unreferenced, but a prefix index still maps a hash to it, so a later
  request with the same prefix can pick it up without recomputing. Cached pages
  wait in one of two eviction orders: the LRU of unprotected pages (oldest
  release first), then the `RetentionQueue` of pages a finished session turn
  retained (earliest expiry first; see retention.py). Allocation evicts only
  when the free list is empty, and tells the index to forget the page;
* draining: unreferenced and unindexed, but a copy in flight still reads it
  (a retracted request's private page on its way to the host): it joins the
  free list when that copy is confirmed.

Copies in flight are tracked per page, across those places: `pins` counts the
copies that read or write a page (a pinned page is never handed out, so no
copy reads a page someone else is already overwriting), and `pending` marks a
page a copy is still writing (nobody may read it until the copy lands).
So the books are `free + referenced + cached + draining == total`, and
`allocatable = free + cached - pinned cached`.

Keeping cached pages out of the free list is what turns finished agent turns
into prefix hits on the next turn, while eviction (LRU, then retained pages)
guarantees the pool can always satisfy an allocation that fits in the
allocatable pages: retention and copies are soft, they never wedge the pool.

The pool also keeps a weak registry of live `BlockTable`s so that
`check_invariants` can prove each refcount equals the number of handles
holding the page: a handle dropped without `release()` shows up as a leak.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tokenspeed.kvcache.errors import OutOfPages, PageRefError
from tokenspeed.kvcache.retention import RetentionQueue

if TYPE_CHECKING:
    from tokenspeed.kvcache.block_table import BlockTable

Clock = Callable[[], float]
EvictHook = Callable[[int, bool], None]  # (page, evicted while its retention still held)
UNPROTECTED = -math.inf  # the protection of a cached page nobody retained


class PagePool:
    __slots__ = (
        "num_pages",
        "page_size",
        "_refcount",
        "_cached",
        "_free",
        "_lru",
        "_kept",
        "_retention",
        "_draining",
        "_pins",
        "_pinned",
        "_num_pinned_evictable",
        "_pending",
        "_num_referenced",
        "_on_evict",
        "_holders",
        "_clock",
    )

    def __init__(self, num_pages: int, page_size: int, clock: Clock = time.monotonic) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}.")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}.")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcount = [0] * num_pages
        # True while a prefix index maps some hash to the page.
        self._cached = [False] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()  # unprotected cached; first = evicted first
        self._kept = RetentionQueue()  # retained cached, evicted after every unprotected one
        self._retention: dict[int, tuple[str, float]] = {}  # cached page -> (session, retained until)
        self._draining: set[int] = set()
        self._pins = [0] * num_pages
        self._pinned: set[int] = set()
        self._num_pinned_evictable = 0  # pinned pages waiting in an eviction order (allocation skips them)
        self._pending: set[int] = set()
        self._num_referenced = 0
        self._on_evict: EvictHook | None = None
        self._holders: weakref.WeakSet[BlockTable] = weakref.WeakSet()
        self._clock = clock

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
        return len(self._lru) + len(self._kept)

    @property
    def num_retained(self) -> int:
        """Cached unreferenced pages still protected by a session's retention (expiries applied first)."""
        self._expire()
        return len(self._kept)

    @property
    def num_draining(self) -> int:
        return len(self._draining)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_allocatable(self) -> int:
        return len(self._free) + self.num_cached_unreferenced - self._num_pinned_evictable

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return self._cached[page]

    def is_pending(self, page: int) -> bool:
        """A copy is still writing this page: its content must not be read yet."""
        return page in self._pending

    def pins(self, page: int) -> int:
        return self._pins[page]

    def retention(self, page: int) -> tuple[str, float] | None:
        """(session, until) while a retention covers the cached page."""
        return self._retention.get(page)

    def protection(self, page: int) -> float:
        """Until when eviction should spare this cached page (`UNPROTECTED` if nobody retained it)."""
        record = self._retention.get(page)
        return UNPROTECTED if record is None else record[1]

    def eviction_order(self) -> list[int]:
        """Cached unreferenced pages, next to be evicted first (pinned ones are skipped by allocation)."""
        self._expire()
        return [*self._lru, *self._kept]

    def iter_evictable(self) -> Iterator[int]:
        """Cached unreferenced pages in eviction order, lazily (callers stop early).

        Includes pages pinned by copies (allocation skips those until the copy is
        confirmed). The caller may pin what it is handed, but must not otherwise change
        the pool while iterating.
        """
        self._expire()
        yield from self._lru
        yield from self._kept

    def touch(self, page: int) -> None:
        """A use of an unreferenced cached page (a host hit copied it up): evict it last among its peers."""
        if page in self._lru:
            self._lru.move_to_end(page)

    # ---- wiring for the prefix index and handles -----------------------------

    def set_evict_hook(self, hook: EvictHook) -> None:
        """`hook(page, protected)` runs when a cached page is evicted for reuse (the index forgets it)."""
        self._on_evict = hook

    def mark_cached(self, page: int) -> None:
        """The prefix index now maps a hash to `page` (which a handle references)."""
        if self._refcount[page] <= 0:
            raise PageRefError(f"page {page} is not referenced; only computed pages can be indexed")
        self._cached[page] = True

    def unmark_cached(self, page: int) -> None:
        """The index drops an unreferenced page whose content never landed (a failed load)."""
        if self._refcount[page] != 0 or not self._cached[page]:
            raise PageRefError(f"page {page} is not a cached unreferenced page")
        self._leave_eviction_order(page)
        self._cached[page] = False
        self._retention.pop(page, None)
        self._park(page)

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
        available = self.num_allocatable
        if n > available:
            raise OutOfPages(n, available)
        pages = [self._take(math.inf) for _ in range(n)]
        assert all(p is not None for p in pages), "allocatable pages were miscounted"
        return [p for p in pages if p is not None]

    def allocate_one(self, evict_retained_before: float, spare: Callable[[int], bool] | None = None) -> int | None:
        """One page with refcount 1, or None (soft: for copies, never for a request's own KV).

        Takes a free page, else evicts an unprotected cached page, else a retained one
        expiring before `evict_retained_before` (a copy never displaces a page its own
        session values more than the page being copied). Cached pages for which `spare`
        says True are skipped, as pinned ones are (write-back spares host copies of
        pages the device still holds: see `tier_transfers.writeback`).
        """
        return self._take(evict_retained_before, spare)

    def reclaim(self, page: int) -> int:
        """Evict this cached, unreferenced, unpinned page now and hand it out with refcount 1.

        For a caller that picked the victim itself (write-back trading a redundant host
        copy for a more urgent one); the prefix index forgets the page as on any eviction.
        """
        if self._refcount[page] or not self._cached[page] or self._pins[page]:
            raise PageRefError(f"page {page} is not a cached, unreferenced page without copies in flight")
        self._expire()
        protected = page in self._kept
        self._leave_eviction_order(page)
        self._evict(page, protected)
        self._refcount[page] = 1
        self._num_referenced += 1
        return page

    def incref(self, page: int) -> None:
        """Take one more reference: a prefix-cache hit (possibly on a page another request holds)."""
        count = self._refcount[page]
        if count == 0:
            if not self._cached[page]:
                raise PageRefError(f"page {page} is free; take new pages with allocate()")
            self._leave_eviction_order(page)  # cache hit on an unreferenced page: no longer evictable
            self._num_referenced += 1
        self._refcount[page] = count + 1

    def decref(self, page: int) -> None:
        """Drop one reference; the last one sends the page to an eviction order (if cached) or away."""
        count = self._refcount[page]
        if count <= 0:
            raise PageRefError(f"page {page} released more times than it was acquired")
        self._refcount[page] = count - 1
        if count == 1:
            self._num_referenced -= 1
            if self._cached[page]:
                self._enter_eviction_order(page)
            else:
                self._park(page)

    # ---- copies in flight ----------------------------------------------------------

    def pin(self, page: int, *, pending: bool = False) -> None:
        """A copy now reads (or, `pending`, writes) this page: it is not reused until `unpin`."""
        if self._refcount[page] == 0 and not self._cached[page] and page not in self._draining:
            raise PageRefError(f"page {page} is free; a copy may only touch a page somebody holds")
        if page in self._pending:
            raise PageRefError(f"page {page} is still being written by a copy; it cannot be copied yet")
        if not self._pins[page] and self._refcount[page] == 0 and self._cached[page]:
            self._num_pinned_evictable += 1
        self._pins[page] += 1
        self._pinned.add(page)
        if pending:
            self._pending.add(page)

    def land(self, page: int) -> None:
        """The copy writing this page was confirmed: its content may be read."""
        if page not in self._pending:
            raise PageRefError(f"page {page} has no copy landing")
        self._pending.discard(page)

    def unpin(self, page: int) -> None:
        """A copy touching this page was confirmed; a draining page with no copy left becomes free."""
        if self._pins[page] <= 0:
            raise PageRefError(f"page {page} has no copy in flight")
        self._pins[page] -= 1
        if self._pins[page] == 0:
            if self._refcount[page] == 0 and self._cached[page]:
                self._num_pinned_evictable -= 1
            self._pinned.discard(page)
            self._pending.discard(page)
            if page in self._draining:
                self._draining.discard(page)
                self._free.append(page)

    # ---- retention --------------------------------------------------------------------

    def retain(self, page: int, session: str, until: float) -> None:
        """Protect a cached page until `until` (the later of this and any earlier retention)."""
        if not self._cached[page]:
            raise PageRefError(f"page {page} is not indexed; only cached pages can be retained")
        old = self._retention.get(page)
        if (old is not None and old[1] >= until) or until <= self._clock():
            return  # nothing to extend
        self._retention[page] = (session, until)
        if self._refcount[page] == 0:  # re-file it under its new protection
            self._leave_eviction_order(page)
            self._enter_eviction_order(page)

    def _expire(self) -> None:
        """Retained unreferenced pages whose expiry passed become the coldest unprotected pages."""
        expired = self._kept.pop_expired(self._clock())
        for page in reversed(expired):
            del self._retention[page]
            self._lru[page] = None
            self._lru.move_to_end(page, last=False)

    # ---- internals --------------------------------------------------------------------

    def _take(self, evict_retained_before: float, spare: Callable[[int], bool] | None = None) -> int | None:
        if self._free:
            page = self._free.popleft()
        else:
            self._expire()
            victim = self._victim(evict_retained_before, spare)
            if victim is None:
                return None
            page, protected = victim
            self._evict(page, protected)
        self._refcount[page] = 1
        self._num_referenced += 1
        return page

    def _evict(self, page: int, protected: bool) -> None:
        """`page` left its eviction order for reuse: the index forgets it."""
        self._cached[page] = False
        self._retention.pop(page, None)
        if self._on_evict is not None:
            self._on_evict(page, protected)

    def _victim(self, evict_retained_before: float, spare: Callable[[int], bool] | None) -> tuple[int, bool] | None:
        """The next unpinned, unspared cached page to evict, and whether a retention still protected it."""
        pinned = self._pinned
        for page in self._lru:
            if page not in pinned and (spare is None or not spare(page)):
                del self._lru[page]
                return page, False

        def eligible(p: int) -> bool:
            return p not in pinned and (spare is None or not spare(p))

        retained = self._kept.pop_first(eligible, evict_retained_before)
        return None if retained is None else (retained, True)

    def _enter_eviction_order(self, page: int) -> None:
        if page in self._pinned:
            self._num_pinned_evictable += 1
        record = self._retention.get(page)
        if record is not None and record[1] > self._clock():
            self._kept.add(page, record[1])
        else:
            self._retention.pop(page, None)
            self._lru[page] = None  # most recently released: evicted last

    def _leave_eviction_order(self, page: int) -> None:
        if page in self._pinned:
            self._num_pinned_evictable -= 1
        if page in self._kept:
            self._kept.remove(page)
        else:
            del self._lru[page]

    def _park(self, page: int) -> None:
        """An unreferenced, unindexed page: free, unless a copy still reads it."""
        if self._pins[page]:
            self._draining.add(page)
        else:
            self._free.append(page)

    # ---- checking ----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's books do not balance."""
        total = self.num_pages
        free = set(self._free)
        lru = set(self._lru)
        kept = set(self._kept)
        draining = self._draining
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & lru, f"pages both free and cached: {sorted(free & lru)}"
        assert not lru & kept, f"pages both unprotected and retained: {sorted(lru & kept)}"
        assert not (free | lru | kept) & draining, "a draining page is also free or cached"
        referenced = {p for p in range(total) if self._refcount[p] > 0}
        negative = [p for p in range(total) if self._refcount[p] < 0 or self._pins[p] < 0]
        assert not negative, f"negative refcounts on pages {negative}"
        assert not referenced & free, f"pages both free and referenced: {sorted(referenced & free)}"
        assert not referenced & (lru | kept), f"pages both cached-unreferenced and referenced: {sorted(referenced & lru)}"
        assert not referenced & draining, "a draining page is referenced"
        assert len(referenced) == self._num_referenced, "referenced-page counter is out of sync"
        assert len(free) + len(referenced) + len(lru) + len(kept) + len(draining) == total, (
            f"free {len(free)} + referenced {len(referenced)} + cached {len(lru) + len(kept)} "
            f"+ draining {len(draining)} != total {total}"
        )
        for page in free:
            assert not self._cached[page], f"free page {page} is still in the prefix index"
            assert not self._pins[page], f"free page {page} has a copy in flight"
        for page in lru | kept:
            assert self._cached[page], f"evictable page {page} is not in the prefix index"
        for page in kept:
            assert self._retention[page][1] == self._kept.until(page), f"retained page {page} is misfiled"
        for page in draining:
            assert self._pins[page] and not self._cached[page], f"draining page {page} has no copy or is indexed"
        assert self._pinned == {p for p in range(total) if self._pins[p]}, "pinned-page set is out of sync"
        assert self._pending <= self._pinned, "a page is being written by no copy"
        assert self._num_pinned_evictable == len(self._pinned & (lru | kept)), "pinned-evictable count is out of sync"
        assert all(self._cached[p] for p in self._retention), "a retention record outlived its page's index entry"
        self._kept.check_invariants()
        held: Counter[int] = Counter()
        for table in self._holders:
            held.update(table.held_pages())
        for page in range(total):
            assert held[page] == self._refcount[page], (
                f"page {page} has refcount {self._refcount[page]} but {held[page]} live BlockTables "
                "hold it (a handle was dropped without release(), or a reference was taken outside one)"
            )
