"""Partial retraction: take a running request's KV off the device, keep what others share.

When the device pool runs out, the scheduler picks a victim. Recompute
preemption throws its KV away; a full retraction copies every page to the
host. Most of an agent request's pages are its prompt prefix, which is
published in the prefix index and often held by other requests too, so
`retract` splits the victim's computed pages:

* shared (held by another table, or indexed by the prefix cache): the victim
  just drops its reference. The page stays on the device for as long as the
  cache keeps it (write-back copies it to the host before it is evicted, like
  any cached page), and `restore` finds it again by its chained hash;
* private (its own unpublished pages: the partial last page, a page whose
  hash another page already held, a prompt computed with caching off): copied
  to a host slot the `Retraction` owns (DEVICE_TO_HOST); the device page
  drains (joins the free list when the copy is confirmed).

So bytes moved are the private pages only (`Retraction.bytes_moved`, beside
`bytes_full` for a full retraction). Retraction is soft, like everything in
the tiers: if the host cannot take a private page, that page and every later
one are left out and will be recomputed.

`restore` rebuilds a device table page by page, in order: a page still on
the device (by hash) is re-acquired; a private page is loaded from its host
slot; a shared page that was evicted is loaded from the host cache if a copy
is there; else restoration stops and the rest is recomputed
(`Restored.num_computed_tokens` says how much KV the table holds). Loads are
HOST_TO_DEVICE copies: the table is not `ready` until they land.

`Retraction` is a linear handle like `BlockTable`: `restore` or `discard`
(the request was aborted while retracted) consumes it, and any later use
raises `StaleBlockTable`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenspeed.kvcache.block_table import BlockTable
from tokenspeed.kvcache.copy_ops import CopyKind
from tokenspeed.kvcache.errors import KVCacheError, StaleBlockTable
from tokenspeed.kvcache.tier_transfers import emit_load, load_from_host

if TYPE_CHECKING:
    from tokenspeed.kvcache.kv_cache import KVCache


class Retraction:
    """A retracted request's KV: page i is on the device (`shared[i]`) or in the next host slot."""

    __slots__ = ("num_computed_tokens", "hashes", "shared", "host_table", "bytes_moved", "bytes_full", "_consumed_by")

    def __init__(
        self,
        num_computed_tokens: int,
        hashes: list[bytes],
        shared: list[bool],
        host_table: BlockTable | None,
        bytes_moved: int,
        bytes_full: int,
    ) -> None:
        self.num_computed_tokens = num_computed_tokens  # of the request when it was retracted
        self.hashes = hashes  # chained hashes of its published pages (a prefix of `shared`, or all of it)
        self.shared = shared  # per saved page, in position order
        self.host_table = host_table  # the private pages' host slots, in position order
        self.bytes_moved = bytes_moved
        self.bytes_full = bytes_full
        self._consumed_by: str | None = None

    def __repr__(self) -> str:
        return f"Retraction(pages={len(self.shared)}, private={self.num_private}, <{self._consumed_by or 'live'}>)"

    @property
    def num_pages(self) -> int:
        """Leading pages of the request this retraction can bring back."""
        return len(self.shared)

    @property
    def num_private(self) -> int:
        return len(self.shared) - sum(self.shared)

    def ensure_live(self) -> None:
        if self._consumed_by is not None:
            raise StaleBlockTable(f"this Retraction was consumed by {self._consumed_by}()")

    def discard(self) -> None:
        """Give up the host copies (the request ended while retracted)."""
        self._consume("discard")

    def _consume(self, how: str) -> None:
        self.ensure_live()
        self._consumed_by = how
        if self.host_table is not None:
            self.host_table.release()


@dataclass(slots=True)
class Restored:
    table: BlockTable  # device pages of the restored prefix (loads may still be in flight)
    num_computed_tokens: int  # tokens whose KV `table` holds once its loads land
    pages_loaded: int  # host -> device copies emitted
    pages_reacquired: int  # pages found still on the device


def retract(kv: KVCache, table: BlockTable, num_computed_tokens: int) -> Retraction:
    """Release `table`, saving its computed private pages to host slots; the record to restore from."""
    table.ensure_live()
    pool, host = kv.pool, kv.host
    pages = table.pages
    published = table.published_hashes()
    computed = min(len(pages), kv.pages_for(num_computed_tokens))
    host_table = None if host is None else BlockTable(host.pool)
    shared: list[bool] = []
    for i in range(computed):
        page = pages[i]
        if pool.refcount(page) > 1 or kv.index.hash_of(page) is not None:
            shared.append(True)
            continue
        if host is None or host_table is None or pool.is_pending(page):
            break  # nowhere to put it (or its own restore has not landed): recompute from here
        slot = host.pool.allocate_one(evict_retained_before=math.inf)
        if slot is None:
            break
        host_table._adopt([slot])
        host.pool.pin(slot, pending=True)
        pool.pin(page)
        page_hash = published[i] if i < len(published) else None
        kv.copies.emit(CopyKind.DEVICE_TO_HOST, device_page=page, host_slot=slot, page_hash=page_hash)
        shared.append(False)
    table.release()  # shared pages stay cached or held by others; private ones drain
    saved_private = shared.count(False)
    counters = kv.counters
    counters.pages_retracted += saved_private
    counters.pages_retracted_full += computed
    counters.pages_retract_lost += computed - len(shared)
    size = kv.bytes_per_page
    kept = min(num_computed_tokens, len(shared) * kv.page_size)
    return Retraction(kept, published[: len(shared)], shared, host_table, saved_private * size, computed * size)


def is_restorable(kv: KVCache, retraction: Retraction) -> bool:
    """True once every private page's copy to the host has landed."""
    retraction.ensure_live()
    host_table = retraction.host_table
    if host_table is None or kv.host is None:
        return True
    return not any(kv.host.pool.is_pending(slot) for slot in host_table.held_pages())


def pages_to_restore(kv: KVCache, retraction: Retraction) -> int:
    """Device pages `restore` would allocate now (pages not found on the device by hash)."""
    retraction.ensure_live()
    on_device = sum(
        1 for page_hash in retraction.hashes if kv.enable_prefix_caching and kv.index.lookup(page_hash) is not None
    )
    return retraction.num_pages - on_device


def restore(kv: KVCache, retraction: Retraction) -> Restored:
    """A device table for the longest prefix of the retracted pages that can be brought back."""
    if not is_restorable(kv, retraction):
        raise KVCacheError("restore() before the retraction's copies to the host landed (see is_restorable)")
    table = BlockTable(kv.pool)
    loaded = reacquired = private = 0
    for i, shared in enumerate(retraction.shared):
        page_hash = retraction.hashes[i] if i < len(retraction.hashes) else None
        slot = None
        if not shared:
            assert retraction.host_table is not None
            slot = retraction.host_table.page_at(private)
            private += 1
        on_device = None if page_hash is None or not kv.enable_prefix_caching else kv.index.lookup(page_hash)
        if on_device is not None and page_hash is not None:
            table._acquire(on_device)
            table._record_hash(page_hash)
            reacquired += 1
        elif slot is not None and kv.can_allocate(1):
            (page,) = kv.pool.allocate(1)
            table._adopt([page])
            if page_hash is not None:
                table._record_hash(page_hash)
                kv.index.insert(page_hash, page)
            emit_load(kv, slot, page, page_hash)
            loaded += 1
        elif slot is None and page_hash is not None and load_from_host(kv, table, page_hash):
            loaded += 1
        else:
            break
    retraction._consume("restore")  # host slots being read drain; the others are free
    kv.counters.pages_restored += loaded
    kv.counters.pages_reacquired += reacquired
    restored = len(table)
    whole = restored == retraction.num_pages
    computed = retraction.num_computed_tokens if whole else restored * kv.page_size
    return Restored(table, computed, loaded, reacquired)
