"""`KVCache`: the one object the scheduler talks to about KV pages.

It wires the page pool to the prefix index and keeps the rules in one place:
matching returns FULL pages only (the caller bounds how many, so a request
always computes at least one token and gets logits to sample from);
allocation is all-or-nothing (`OutOfPages`, so a failed step never leaves
half-grown tables behind); publishing is incremental (each table remembers
how far it was hashed). With prefix caching disabled nothing is ever indexed,
so every released page goes straight back to the free list: the off switch
(`--disable-prefix-cache`), and the baseline the cached runs are compared against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenspeed.kvcache.block_table import BlockTable
from tokenspeed.kvcache.events import KVEventLog
from tokenspeed.kvcache.page_pool import PagePool
from tokenspeed.kvcache.prefix_index import PrefixIndex, chain_hash


@dataclass(slots=True, frozen=True)
class KVCacheStats:
    total: int
    free: int
    referenced: int
    cached_unreferenced: int
    indexed: int  # pages the prefix index maps (referenced or not)


class KVCache:
    __slots__ = ("pool", "index", "enable_prefix_caching")

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.index = PrefixIndex(self.pool)
        self.enable_prefix_caching = enable_prefix_caching

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

    def match_prefix(self, token_ids: Sequence[int], max_pages: int) -> BlockTable:
        """A table holding the longest cached run of full pages of `token_ids` (at most `max_pages`).

        Each matched page is acquired (refcount + 1; an unreferenced one leaves the
        LRU). `table.num_published == len(table)`: the hashes come with the pages.
        """
        table = BlockTable(self.pool)
        if not self.enable_prefix_caching:
            return table
        size = self.pool.page_size
        limit = min(max_pages, len(token_ids) // size)
        parent: bytes | None = None
        for i in range(limit):
            page_hash = chain_hash(parent, token_ids[i * size : (i + 1) * size])
            page = self.index.lookup(page_hash)
            if page is None:
                break
            table._acquire(page)
            table._record_hash(page_hash)
            parent = page_hash
        return table

    def can_allocate(self, n: int) -> bool:
        return n <= self.pool.num_allocatable

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

    def stats(self) -> KVCacheStats:
        pool = self.pool
        return KVCacheStats(
            total=pool.num_pages,
            free=pool.num_free,
            referenced=pool.num_referenced,
            cached_unreferenced=pool.num_cached_unreferenced,
            indexed=len(self.index),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if any page is lost, double-counted or referenced by no handle."""
        self.pool.check_invariants()
        self.index.check_invariants()
