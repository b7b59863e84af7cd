"""`KVCache`: the one object the scheduler talks to about KV pages, on every tier.

It wires the page pool to the prefix index and keeps the rules in one place:
matching returns FULL pages only (the caller bounds how many, so a request
always computes at least one token and gets logits to sample from);
allocation is all-or-nothing (`OutOfPages`, so a failed step never leaves
half-grown tables behind); publishing is incremental (each table remembers
how far it was hashed). With prefix caching disabled nothing is ever indexed,
so every released page goes straight back to the free list: the off switch
(`--disable-prefix-cache`), and the baseline the cached runs are compared against.

With a `KVTierConfig` it also keeps a host tier (a second pool of slots sized
from `host_kv_cache_bytes`, indexed by the same chained hash) and optionally a
disk tier (`kv_cache_dir`): matching then loads host hits (tier_transfers.py),
`writeback` copies pages about to be evicted one tier down, `retain` protects
a finished turn's pages for its session (retention.py), and `retract` /
`restore` move a preempted request's private pages to the host and back
(retraction.py). Every copy is a `CopyOp` the executor takes with
`take_copies()` and confirms with `complete()`; without tiers none is ever
made and the cache behaves exactly as a single device pool.

Time (retention expiry) comes from an injectable `clock`, so tests drive it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tokenspeed.kvcache.block_table import BlockTable
from tokenspeed.kvcache.copy_ops import CopyKind, CopyLedger, CopyOp
from tokenspeed.kvcache.disk_tier import DiskTier
from tokenspeed.kvcache.events import KVEventLog
from tokenspeed.kvcache.page_file import KVLayout, PageFileStore
from tokenspeed.kvcache.page_pool import Clock, PagePool
from tokenspeed.kvcache.prefix_index import PrefixIndex, chain_hash
from tokenspeed.kvcache.retraction import (
    Restored,
    Retraction,
    is_restorable,
    pages_to_restore,
    restore,
    retract,
)
from tokenspeed.kvcache.tier_stats import DiskBooks, TierBooks, TierCounters, TierStats, snapshot
from tokenspeed.kvcache.tier_transfers import (
    PageLocation,
    complete,
    load_from_host,
    lookup,
    prefetch,
    writeback,
)

DEFAULT_SESSION_TTL = 300.0  # seconds a finished turn's pages stay protected (`--session-ttl`)


@dataclass(slots=True, frozen=True)
class KVTierConfig:
    """The tiers below the device pool (vLLM-style option names)."""

    layout: KVLayout  # what a page's bytes are; sizes the tiers and fingerprints disk files
    host_kv_cache_bytes: int = 0  # 0: no host tier
    kv_cache_dir: str | None = None  # None: no disk tier
    kv_cache_dir_bytes: int = 0
    session_ttl: float = DEFAULT_SESSION_TTL


@dataclass(slots=True, frozen=True)
class KVCacheStats:
    total: int
    free: int
    referenced: int
    cached_unreferenced: int
    indexed: int  # pages the prefix index maps (referenced or not)
    draining: int = 0  # unreferenced pages a copy to the host still reads


@dataclass(slots=True)
class HostTier:
    pool: PagePool  # host slots; a retracted request's private pages are held by its `Retraction`
    index: PrefixIndex  # cached slots by chained hash, exactly as the device index


class KVCache:
    __slots__ = (
        "pool",
        "index",
        "enable_prefix_caching",
        "host",
        "disk",
        "bytes_per_page",
        "session_ttl",
        "copies",
        "counters",
        "clock",
    )

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        *,
        tiers: KVTierConfig | None = None,
        clock: Clock = time.monotonic,
        disk_store: PageFileStore | None = None,
    ) -> None:
        self.clock = clock
        self.pool = PagePool(num_pages, page_size, clock)
        self.index = PrefixIndex(self.pool, self._device_evicted)
        self.enable_prefix_caching = enable_prefix_caching
        self.copies = CopyLedger()
        self.counters = TierCounters()
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self.bytes_per_page = 0
        self.session_ttl = DEFAULT_SESSION_TTL
        if tiers is not None:
            self._open_tiers(tiers, disk_store)

    def _open_tiers(self, tiers: KVTierConfig, disk_store: PageFileStore | None) -> None:
        layout = tiers.layout
        if layout.page_size != self.page_size:
            raise ValueError(f"the KV layout has page_size {layout.page_size}, the pool {self.page_size}.")
        if tiers.session_ttl < 0:
            raise ValueError(f"session_ttl must be >= 0 seconds, got {tiers.session_ttl}.")
        self.bytes_per_page = layout.bytes_per_page
        self.session_ttl = tiers.session_ttl
        num_slots = tiers.host_kv_cache_bytes // layout.bytes_per_page
        if tiers.host_kv_cache_bytes > 0:
            if num_slots < 1:
                raise ValueError(
                    f"host_kv_cache_bytes={tiers.host_kv_cache_bytes} cannot hold one KV page of "
                    f"{layout.bytes_per_page} bytes."
                )
            pool = PagePool(num_slots, self.page_size, self.clock)
            self.host = HostTier(pool, PrefixIndex(pool, self._host_evicted))
        if tiers.kv_cache_dir is not None or disk_store is not None:
            if self.host is None:
                raise ValueError("the disk tier (kv_cache_dir) is filled from the host tier: set host_kv_cache_bytes.")
            if disk_store is not None:
                self.disk = DiskTier(disk_store, layout, tiers.kv_cache_dir_bytes)
            else:
                assert tiers.kv_cache_dir is not None
                self.disk = DiskTier.open(tiers.kv_cache_dir, layout, tiers.kv_cache_dir_bytes)

    def _device_evicted(self, page_hash: bytes, protected: bool) -> None:
        if protected:
            self.counters.retention_evictions += 1
        if self.host is not None and self.host.index.lookup(page_hash) is None:
            self.counters.device_drops += 1

    def _host_evicted(self, page_hash: bytes, protected: bool) -> None:
        if self.disk is not None and not self.disk.contains(page_hash):
            self.counters.host_drops += 1

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def events(self) -> KVEventLog:
        """Stored/removed page records for a cache-aware router (`kvcache/events.py`); off until enabled."""
        return self.index.events

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold positions 0 .. num_tokens-1."""
        return -(-num_tokens // self.pool.page_size)

    def new_block_table(self) -> BlockTable:
        return BlockTable(self.pool)

    # ---- the device pool ------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], max_pages: int) -> BlockTable:
        """A table holding the longest cached run of full pages of `token_ids` (at most `max_pages`).

        Each device hit is acquired (refcount + 1; an unreferenced one leaves the
        eviction order). With a host tier a page found only on the host is loaded into
        a new device page (a HOST_TO_DEVICE copy: the table is not `is_ready` until it
        lands); use `lookup` first to see what a match would cost without taking anything.
        `table.num_published == len(table)`: the hashes come with the pages.
        """
        table = BlockTable(self.pool)
        if not self.enable_prefix_caching:
            return table
        size = self.pool.page_size
        parent: bytes | None = None
        for i in range(min(max_pages, len(token_ids) // size)):
            page_hash = chain_hash(parent, token_ids[i * size : (i + 1) * size])
            page = self.index.lookup(page_hash)
            if page is not None:
                table._acquire(page)
                table._record_hash(page_hash)
            elif load_from_host(self, table, page_hash):
                self.counters.host_hit_pages += 1
                self.index.events.stored(parent, [page_hash], token_ids[i * size : (i + 1) * size])
            else:
                break
            parent = page_hash
        return table

    def can_allocate(self, n: int) -> bool:
        return n <= self.pool.num_allocatable

    def can_allocate_soon(self, n: int) -> bool:
        """`n` pages will be allocatable once the copies in flight land (drained and unpinned pages)."""
        pool = self.pool
        held_by_copies = pool.num_draining + pool.num_free + pool.num_cached_unreferenced - pool.num_allocatable
        return held_by_copies > 0 and n <= pool.num_allocatable + held_by_copies

    def allocate(self, table: BlockTable, n: int) -> list[int]:
        """Append `n` new pages to `table`; raises `OutOfPages` (taking nothing) if impossible."""
        table.ensure_live()
        pages = self.pool.allocate(n)
        table._adopt(pages)
        return pages

    def publish(self, table: BlockTable, token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Index every full page of `table` whose tokens are all computed; returns pages newly hashed.

        `token_ids` are the table's tokens from position 0 (only the new pages are read).
        A page whose hash another page already holds is hashed (the chain goes on)
        but stays unindexed.
        """
        if not self.enable_prefix_caching:
            return 0
        size = self.pool.page_size
        full = min(num_computed_tokens // size, len(table), len(token_ids) // size)
        start = table.num_published
        parent = table.last_hash
        log = self.index.events
        run: list[bytes] = []  # consecutive newly indexed pages, for the event log
        run_parent, run_start = parent, start
        for i in range(start, full):
            page_hash = chain_hash(parent, token_ids[i * size : (i + 1) * size])
            if self.index.insert(page_hash, table.page_at(i)):
                run.append(page_hash)
            else:  # another page holds this hash: the run ends before it
                if log.enabled:
                    log.stored(run_parent, run, token_ids[run_start * size : i * size])
                run, run_parent, run_start = [], page_hash, i + 1
            table._record_hash(page_hash)
            parent = page_hash
        if log.enabled:
            log.stored(run_parent, run, token_ids[run_start * size : full * size])
        return max(0, full - start)

    def is_ready(self, table: BlockTable) -> bool:
        """No page of `table` is still being filled by a copy (safe to read all of them)."""
        if not self.pool.num_pending:
            return True
        return not any(self.pool.is_pending(page) for page in table.held_pages())

    # ---- retention ----------------------------------------------------------------------

    def retain(self, table: BlockTable, session: str, ttl: float | None = None, num_pages: int | None = None) -> int:
        """Protect the indexed pages of a finishing turn (the first `num_pages`) for `ttl` seconds.

        Call before releasing the table. `ttl` defaults to `session_ttl` (Anthropic
        `cache_control.ttl` maps here); `num_pages` bounds it to a cacheable prefix
        (a `cache_control` breakpoint). Returns the pages protected.
        """
        until = self.clock() + (self.session_ttl if ttl is None else ttl)
        pages = table.pages if num_pages is None else table.pages[:num_pages]
        protected = 0
        for page in pages:
            if self.index.hash_of(page) is not None:
                self.pool.retain(page, session, until)
                protected += 1
        return protected

    # ---- tiers ----------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], max_pages: int) -> list[PageLocation]:
        """Where each leading full page of `token_ids` lives (device, host, disk); no side effects."""
        return lookup(self, token_ids, max_pages)

    def writeback(self, max_pages: int, *, horizon: int | None = None, max_disk_pages: int = 0) -> int:
        """Copy up to `max_pages` of the next device pages to be evicted to the host (and host slots to disk)."""
        return writeback(self, max_pages, horizon, max_disk_pages)

    def prefetch(self, token_ids: Sequence[int], max_pages: int) -> int:
        """Start reading the disk hits among `token_ids`'s leading pages into the host tier."""
        return prefetch(self, token_ids, max_pages)

    def retract(self, table: BlockTable, num_computed_tokens: int) -> Retraction:
        """Release a victim's table, moving its private computed pages to the host (retraction.py)."""
        return retract(self, table, num_computed_tokens)

    def is_restorable(self, retraction: Retraction) -> bool:
        return is_restorable(self, retraction)

    def pages_to_restore(self, retraction: Retraction) -> int:
        return pages_to_restore(self, retraction)

    def restore(self, retraction: Retraction) -> Restored:
        return restore(self, retraction)

    def take_copies(self) -> list[CopyOp]:
        """Copies emitted since the last call, for the executor (they stay in flight until `complete`)."""
        return self.copies.take()

    def complete(self, op_id: int, ok: bool = True) -> None:
        """The executor finished copy `op_id` (`ok=False`: a disk file failed to write or verify)."""
        complete(self, op_id, ok)

    # ---- books ------------------------------------------------------------------------------

    def stats(self) -> KVCacheStats:
        pool = self.pool
        return KVCacheStats(
            total=pool.num_pages,
            free=pool.num_free,
            referenced=pool.num_referenced,
            cached_unreferenced=pool.num_cached_unreferenced,
            indexed=len(self.index),
            draining=pool.num_draining,
        )

    def tier_stats(self) -> TierStats:
        disk = self.disk
        return TierStats(
            device=_books(self.pool),
            host=None if self.host is None else _books(self.host.pool),
            disk=None if disk is None else DiskBooks(len(disk), disk.used_bytes, disk.budget_bytes, disk.num_pending),
            copies_in_flight=len(self.copies),
            counters=snapshot(self.counters),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if any page of any tier is lost, double-counted or misused by a copy.

        Per pool: `free + owned + cached + draining == total`, each refcount equals the
        handles holding the page. Across tiers: the pins and pending marks are exactly
        those of the copies in flight, host slots are either cached or owned by a
        retraction (never both), and the disk stays within its byte budget.
        """
        self.pool.check_invariants()
        self.index.check_invariants()
        host = self.host
        if host is not None:
            host.pool.check_invariants()
            host.index.check_invariants()
            for slot in range(host.pool.num_pages):
                assert not (host.pool.is_cached(slot) and host.pool.refcount(slot)), f"host slot {slot} owned and cached"
        if self.disk is not None:
            self.disk.check_invariants()
        self._check_copies()

    def _check_copies(self) -> None:
        device_pins: Counter[int] = Counter()
        host_pins: Counter[int] = Counter()
        device_pending: set[int] = set()
        host_pending: set[int] = set()
        disk_pins: Counter[bytes] = Counter()
        for op in self.copies.in_flight():
            host_pins[op.host_slot] += 1
            if op.kind is CopyKind.DEVICE_TO_HOST:
                device_pins[op.device_page] += 1
                host_pending.add(op.host_slot)
            elif op.kind is CopyKind.HOST_TO_DEVICE:
                device_pins[op.device_page] += 1
                device_pending.add(op.device_page)
            else:
                assert op.page_hash is not None and self.disk is not None, "a disk copy without a disk tier"
                disk_pins[op.page_hash] += 1
                if op.kind is CopyKind.DISK_TO_HOST:
                    host_pending.add(op.host_slot)
                else:
                    assert not self.disk.is_ready(op.page_hash), "a file still being written is readable"
            self._check_copy_ends(op)
        pool = self.pool
        for page in range(pool.num_pages):
            assert pool.pins(page) == device_pins[page], f"device page {page}: pins disagree with copies in flight"
            assert pool.is_pending(page) == (page in device_pending), f"device page {page}: pending disagrees"
        host = self.host
        assert host is not None or not self.copies.in_flight(), "copies without a host tier"
        if host is not None:
            for slot in range(host.pool.num_pages):
                assert host.pool.pins(slot) == host_pins[slot], f"host slot {slot}: pins disagree with copies"
                assert host.pool.is_pending(slot) == (slot in host_pending), f"host slot {slot}: pending disagrees"
        if self.disk is not None:
            for page_hash in self.disk.eviction_order():
                assert self.disk.pins(page_hash) == disk_pins[page_hash], "disk file pins disagree with copies"


    def _check_copy_ends(self, op: CopyOp) -> None:
        """Both ends of a copy in flight still hold what the copy is about (nothing was reused)."""
        host = self.host
        assert host is not None
        slot, page = op.host_slot, op.device_page
        if op.kind is CopyKind.DEVICE_TO_HOST:
            if host.pool.is_cached(slot):  # write-back: the device page is still that cached page
                assert self.index.hash_of(page) == op.page_hash == host.index.hash_of(slot), "write-back source reused"
            else:  # a retracted request's page: it drains, nobody else holds it
                assert self.pool.refcount(page) == 0 and not self.pool.is_cached(page), "retraction source reused"
        elif op.kind is CopyKind.HOST_TO_DEVICE:
            if op.page_hash is not None and self.pool.is_cached(page):
                assert self.index.hash_of(page) == op.page_hash, "a load lands in a page indexed as another"
            if host.pool.is_cached(slot):
                assert host.index.hash_of(slot) == op.page_hash, "a load reads a host slot reused for another page"
        else:
            assert host.pool.is_cached(slot) and host.index.hash_of(slot) == op.page_hash, "disk copy slot reused"


def _books(pool: PagePool) -> TierBooks:
    return TierBooks(
        total=pool.num_pages,
        free=pool.num_free,
        owned=pool.num_referenced,
        cached=pool.num_cached_unreferenced,
        draining=pool.num_draining,
        retained=pool.num_retained,
        pinned=pool.num_pinned,
        pending=pool.num_pending,
    )
