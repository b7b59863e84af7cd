"""Moving cached pages between tiers: one lookup across tiers, host hits, write-back, prefetch.

The device, host and disk tiers are indexed by the SAME chained page hash, so
one walk of a prompt's hashes finds each page on the fastest tier holding it
(`lookup`): device first, then host, then disk. What happens on a hit:

* device: the page is acquired, as before;
* host: a device page is allocated, indexed under the hash at once (so two
  requests sharing the prefix load it once) and filled by a HOST_TO_DEVICE
  copy. Until that copy is confirmed the page is `pending`: a table holding it
  is not `ready` and must not be read (the executor may also just order the
  copy before the step that reads it; see `KVCache.is_ready`);
* disk: never loaded straight to the device. `prefetch` reads disk hits into
  host slots (DISK_TO_HOST, verified by checksum on the IO thread); a failed
  read is a miss, and the request simply matches fewer pages. So a wrong
  file can delay a request, never feed it wrong KV.

Write-back is ahead of eviction and batched: `writeback` walks the device's
eviction order (unprotected pages, then retained ones by expiry) and copies
the next pages that no host slot holds yet to the host (DEVICE_TO_HOST),
and likewise the host's eviction order to disk. The device page stays cached
and matchable meanwhile; it is only pinned (not evictable) until the copy is
confirmed, after which evicting it loses nothing. A page evicted before any
copy was made is a drop (`TierCounters.device_drops`): allocation never waits
for a copy, so under a burst the pool stays live and only the cache suffers.
A copy never displaces a host slot its session protects longer than the page
being copied (`PagePool.allocate_one`), nor the host copy of a page the device
still caches for a page evicted later (`_WritebackSlots`): so with a host tier
smaller than the device's cached pages write-back converges instead of copying
the same pages round and round (issue 13).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING

from tokenspeed.kvcache.block_table import BlockTable
from tokenspeed.kvcache.copy_ops import CopyKind
from tokenspeed.kvcache.prefix_index import chain_hash

if TYPE_CHECKING:
    from tokenspeed.kvcache.kv_cache import KVCache


class Tier(Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(slots=True, frozen=True)
class PageLocation:
    page_hash: bytes
    tier: Tier  # the fastest tier holding the page
    ready: bool  # False: a copy is still writing it there (wait, or treat as a miss)


def page_hashes(token_ids: Sequence[int], page_size: int, max_pages: int) -> Iterator[bytes]:
    """Chained hashes of the first full pages of `token_ids` (at most `max_pages`)."""
    parent: bytes | None = None
    for i in range(min(max_pages, len(token_ids) // page_size)):
        parent = chain_hash(parent, token_ids[i * page_size : (i + 1) * page_size])
        yield parent


def lookup(kv: KVCache, token_ids: Sequence[int], max_pages: int) -> list[PageLocation]:
    """Where each leading full page of `token_ids` is, up to the first page no tier holds. No side effects."""
    found: list[PageLocation] = []
    if not kv.enable_prefix_caching:
        return found
    host, disk = kv.host, kv.disk
    for page_hash in page_hashes(token_ids, kv.page_size, max_pages):
        page = kv.index.lookup(page_hash)
        slot = None if page is not None or host is None else host.index.lookup(page_hash)
        if page is not None:
            found.append(PageLocation(page_hash, Tier.DEVICE, not kv.pool.is_pending(page)))
        elif slot is not None and host is not None:
            found.append(PageLocation(page_hash, Tier.HOST, not host.pool.is_pending(slot)))
        elif disk is not None and disk.contains(page_hash):
            found.append(PageLocation(page_hash, Tier.DISK, disk.is_ready(page_hash)))
        else:
            break
    return found


def load_from_host(kv: KVCache, table: BlockTable, page_hash: bytes) -> bool:
    """Append a device page for a host hit on `page_hash` to `table` (copy in flight); False if impossible."""
    host = kv.host
    slot = None if host is None else host.index.lookup(page_hash)
    if host is None or slot is None or host.pool.is_pending(slot) or not kv.can_allocate(1):
        return False
    (page,) = kv.pool.allocate(1)
    table._adopt([page])
    kv.index.insert(page_hash, page)
    table._record_hash(page_hash)
    record = host.pool.retention(slot)
    if record is not None:
        kv.pool.retain(page, *record)
    host.pool.touch(slot)
    emit_load(kv, slot, page, page_hash)
    return True


def emit_load(kv: KVCache, slot: int, page: int, page_hash: bytes | None) -> None:
    """HOST_TO_DEVICE from `slot` into `page` (which the caller's table already holds)."""
    assert kv.host is not None
    kv.host.pool.pin(slot)
    kv.pool.pin(page, pending=True)
    kv.copies.emit(CopyKind.HOST_TO_DEVICE, device_page=page, host_slot=slot, page_hash=page_hash)


def writeback(kv: KVCache, max_pages: int, horizon: int | None, max_disk_pages: int) -> int:
    """Copy the next cached pages to be evicted that the tier below lacks; returns copies emitted.

    Looks at the first `horizon` evictable device pages (None: all), copies at most
    `max_pages` of them to the host, then at most `max_disk_pages` host slots to disk.
    """
    host = kv.host
    if host is None:
        return 0
    emitted = 0
    order = list(_first(kv.pool.iter_evictable(), horizon)) if max_pages > 0 else []
    slots = _WritebackSlots(kv, order, lookahead=max_pages)
    for rank, page in enumerate(order):
        if emitted >= max_pages:
            break
        page_hash = kv.index.hash_of(page)
        assert page_hash is not None, "an evictable page is always indexed"
        if kv.pool.is_pending(page) or host.index.lookup(page_hash) is not None:
            continue  # still being loaded, or already on the host (or being copied there)
        slot = slots.take(page, rank)
        if slot is None:
            break  # every host slot is owned, in flight, protected longer, or a copy as urgent
        host.index.insert(page_hash, slot)
        record = kv.pool.retention(page)
        if record is not None:
            host.pool.retain(slot, *record)
        host.pool.pin(slot, pending=True)
        host.pool.decref(slot)  # a cached slot: nobody owns it, the index keeps it
        kv.pool.pin(page)
        kv.copies.emit(CopyKind.DEVICE_TO_HOST, device_page=page, host_slot=slot, page_hash=page_hash)
        emitted += 1
    disk = kv.disk
    if disk is None:
        return emitted
    to_disk = 0
    host_order = list(_first(host.pool.iter_evictable(), horizon)) if max_disk_pages > 0 else []
    host_rank: dict[bytes, int] = {}  # filled when the disk is full (a file must be given up)
    for rank, slot in enumerate(host_order):
        if to_disk >= max_disk_pages:
            break
        page_hash = host.index.hash_of(slot)
        assert page_hash is not None, "an evictable slot is always indexed"
        if host.pool.is_pending(slot) or disk.contains(page_hash):
            continue  # not landed yet, or already on disk
        if len(disk) >= disk.capacity and not host_rank:
            host_rank = {h: r for r, s in enumerate(host_order) if (h := host.index.hash_of(s)) is not None}
        name = disk.reserve(page_hash, partial(_may_drop_file, host_rank, rank, max_disk_pages))
        if name is None:
            break  # every file is being read or written, or one write-back must keep
        host.pool.pin(slot)
        kv.copies.emit(CopyKind.HOST_TO_DISK, host_slot=slot, page_hash=page_hash, file_name=name)
        to_disk += 1
    return emitted + to_disk


class _WritebackSlots:
    """Which host slot a write-back copy of the device page at `rank` (in eviction order) may take.

    A host copy of a page the device still caches is redundant until the device evicts the
    page; write-back exists to have it ready by then. Displacing such a copy for another
    one is what made write-back churn (issue 13): with a host tier smaller than the
    device's cached pages, each copy evicted (host LRU) the copy of a page still on the
    device, which the next batch copied back, forever, even on an idle engine. So a copy
    takes, in order:

    1. a free slot;
    2. the copy of the device page evicted last, if it is evicted after this page and
       beyond the next batch (`lookahead`: the pages the device may evict before write-back
       runs again): nothing is lost now, and that copy was not needed soon;
    3. within the next batch only, a host-only copy (its device page is gone), in the host's
       eviction order and never one its session protects longer than this page: by LRU
       over both tiers it is older than any page the device still holds, and a page about
       to leave the device is worth more; further ahead, giving up a unique copy to
       duplicate a page the device keeps would only shrink what the two tiers hold;
    4. the copy of the device page evicted last, if it is evicted after this page.

    The copy of a page the device is not about to evict (referenced, or beyond the horizon)
    is never displaced by write-back. Every copy thus consumes a free or
    host-only slot, or trades a copy for one of a page evicted sooner; while nothing
    allocates (an idle engine) neither source refills, so write-back makes at most about
    one copy per host slot and then stops, holding the pages the device evicts first.
    """

    __slots__ = ("kv", "order", "lookahead", "_next")

    def __init__(self, kv: KVCache, order: list[int], lookahead: int) -> None:
        self.kv = kv
        self.order = order  # device pages in eviction order (within the horizon)
        self.lookahead = lookahead
        self._next = len(order) - 1  # cursor of rules 2 and 4, from the page evicted last down

    def take(self, page: int, rank: int) -> int | None:
        host = self.kv.host
        assert host is not None
        if host.pool.num_free:
            return host.pool.allocate_one(evict_retained_before=math.inf)
        later = self._latest_copy(rank)
        if later is not None and later[0] >= self.lookahead:
            return self._reclaim(later[1])
        if rank < self.lookahead:
            slot = host.pool.allocate_one(self.kv.pool.protection(page), spare=self._on_device)
            if slot is not None:
                return slot
        return None if later is None else self._reclaim(later[1])

    def _latest_copy(self, rank: int) -> tuple[int, int] | None:
        """(rank, host slot) of the unpinned host copy of the device page evicted last, after `rank`."""
        host = self.kv.host
        assert host is not None
        while self._next > rank:
            page_hash = self.kv.index.hash_of(self.order[self._next])
            slot = None if page_hash is None else host.index.lookup(page_hash)
            if slot is not None and not host.pool.pins(slot):
                return self._next, slot
            self._next -= 1
        return None

    def _reclaim(self, slot: int) -> int:
        assert self.kv.host is not None
        self._next -= 1
        return self.kv.host.pool.reclaim(slot)

    def _on_device(self, slot: int) -> bool:
        """The host slot's page is still cached (or in use) on the device: its copy is not unique."""
        assert self.kv.host is not None
        page_hash = self.kv.host.index.hash_of(slot)
        return page_hash is not None and self.kv.index.lookup(page_hash) is not None


def _may_drop_file(host_rank: dict[bytes, int], rank: int, lookahead: int, page_hash: bytes) -> bool:
    """Host -> disk write-back of the host slot at `rank` may give up the file of `page_hash`.

    The same rule as `_WritebackSlots`, one tier down: a file of a page the host still
    holds is redundant until the host evicts it, so it only gives way to a slot the host
    evicts sooner; a disk-only file, only to a slot within the next batch (`lookahead`).
    Otherwise a disk smaller than the host's cached slots is rewritten forever (issue 13).
    """
    held = host_rank.get(page_hash)
    return rank < lookahead if held is None else held > rank


def prefetch(kv: KVCache, token_ids: Sequence[int], max_pages: int) -> int:
    """Start reading the disk hits of `token_ids`'s leading pages into host slots; returns copies emitted."""
    host, disk = kv.host, kv.disk
    if host is None or disk is None:
        return 0
    emitted = 0
    for location in lookup(kv, token_ids, max_pages):
        if location.tier is not Tier.DISK or not location.ready:
            continue
        slot = host.pool.allocate_one(evict_retained_before=math.inf)
        if slot is None:
            break
        host.index.insert(location.page_hash, slot)
        host.pool.pin(slot, pending=True)
        host.pool.decref(slot)
        name = disk.pin(location.page_hash)
        kv.copies.emit(CopyKind.DISK_TO_HOST, host_slot=slot, page_hash=location.page_hash, file_name=name)
        emitted += 1
    return emitted


def complete(kv: KVCache, op_id: int, ok: bool) -> None:
    """The executor confirms copy `op_id`; `ok=False` (disk copies only): the file could not be used."""
    op = kv.copies.peek(op_id)
    if not ok and op.kind not in (CopyKind.HOST_TO_DISK, CopyKind.DISK_TO_HOST):
        raise ValueError(f"a {op.kind.value} copy cannot fail: only disk copies report ok=False")
    kv.copies.pop(op_id)
    host, counters = kv.host, kv.counters
    assert host is not None, "copies exist only with a host tier"
    size = kv.bytes_per_page
    slot, page_hash = op.host_slot, op.page_hash
    if op.kind is CopyKind.DEVICE_TO_HOST:
        kv.pool.unpin(op.device_page)
        if host.pool.is_cached(slot):  # a write-back, not a retracted request's private page
            counters.pages_spilled += 1
        host.pool.land(slot)
        host.pool.unpin(slot)
        counters.bytes_device_to_host += size
    elif op.kind is CopyKind.HOST_TO_DEVICE:
        host.pool.unpin(slot)
        kv.pool.land(op.device_page)
        kv.pool.unpin(op.device_page)
        counters.bytes_host_to_device += size
    else:
        disk = kv.disk
        assert disk is not None and page_hash is not None, "a disk copy without a disk tier"
        if op.kind is CopyKind.HOST_TO_DISK:
            host.pool.unpin(slot)
            if ok:
                disk.land(page_hash)
                counters.pages_spilled_to_disk += 1
                counters.bytes_host_to_disk += size
            else:
                disk.discard(page_hash)
                counters.disk_bad_files += 1
        else:
            disk.unpin(page_hash)
            if ok:
                host.pool.land(slot)
                counters.disk_hit_pages += 1
                counters.bytes_disk_to_host += size
            else:  # a miss after all: forget the slot and the file
                host.index.discard(slot)
                disk.discard(page_hash)
                counters.disk_bad_files += 1
            host.pool.unpin(slot)


def _first(pages: Iterator[int], limit: int | None) -> Iterator[int]:
    for count, page in enumerate(pages):
        if limit is not None and count >= limit:
            return
        yield page
