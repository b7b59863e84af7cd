"""Host tier: write-back, host hits, copies in flight, accounting across tiers (no scheduler)."""

from __future__ import annotations

import pytest

from tests.kv_tier_sim import (
    FakeClock,
    TierSim,
    check_contents,
    layout,
    page_tokens_by_hash,
    run_prompt,
    tiered_cache,
)
from tokenspeed.kvcache import (
    BlockTable,
    CopyKind,
    KVCache,
    KVTierConfig,
    OutOfPages,
    Tier,
    UnknownCopy,
)

PS = 2
A = [1, 2, 3, 4]
B = [5, 6, 7, 8]


def computed(kv: KVCache, sim: TierSim, tokens: list[int]) -> BlockTable:
    """A table whose pages hold `tokens` (computed and published), taking host hits if any."""
    return run_prompt(kv, sim, tokens, len(tokens) // PS)


def test_write_back_then_host_hit_round_trip() -> None:
    kv = tiered_cache(num_pages=2, page_size=PS, host_slots=4)
    sim = TierSim(kv)
    computed(kv, sim, A).release()
    assert kv.writeback(max_pages=8) == 2
    ops = sim.take()
    assert [op.kind for op in ops] == [CopyKind.DEVICE_TO_HOST] * 2
    assert kv.pool.num_allocatable == 0, "pages a copy still reads are not allocatable"
    with pytest.raises(OutOfPages):
        kv.allocate(kv.new_block_table(), 1)
    for op in reversed(ops):  # confirmations may come in any order
        sim.finish(op.op_id)
    kv.check_invariants()
    computed(kv, sim, B).release()  # evicts A's pages: both are on the host, nothing is lost
    assert kv.counters.device_drops == 0 and kv.counters.pages_spilled == 2
    assert [loc.tier for loc in kv.lookup(A, 2)] == [Tier.HOST, Tier.HOST]
    hit = kv.match_prefix(A + [9], max_pages=2)
    assert len(hit) == 2 and not kv.is_ready(hit) and hit.num_published == 2
    loads = sim.take()
    assert [op.kind for op in loads] == [CopyKind.HOST_TO_DEVICE] * 2
    sim.finish(loads[1].op_id)
    assert not kv.is_ready(hit)
    sim.finish(loads[0].op_id)
    assert kv.is_ready(hit)
    assert [sim.device[p] for p in hit.pages] == [[1, 2], [3, 4]]
    assert kv.counters.host_hit_pages == 2
    assert kv.counters.bytes_host_to_device == 2 * kv.bytes_per_page == kv.counters.bytes_device_to_host
    check_contents(sim, page_tokens_by_hash([A, B], PS))
    hit.release()
    kv.check_invariants()


def test_a_page_being_loaded_is_shared_not_loaded_twice_and_not_readable() -> None:
    kv = tiered_cache(num_pages=4, page_size=PS, host_slots=4)
    sim = TierSim(kv)
    computed(kv, sim, A).release()
    kv.writeback(max_pages=8)
    sim.finish_all()
    filler = computed(kv, sim, B + [9, 10, 11, 12])  # evicts A from the device
    filler.release()
    first = kv.match_prefix(A, 1)
    second = kv.match_prefix(A, 1)  # the same page, still in flight: acquired, not loaded again
    assert first.pages == second.pages and len(sim.take()) == 1
    assert not kv.is_ready(second)
    assert kv.lookup(A, 1)[0].tier is Tier.DEVICE and not kv.lookup(A, 1)[0].ready
    sim.finish_all()
    assert kv.is_ready(first) and kv.is_ready(second)
    first.release()
    second.release()
    kv.check_invariants()


def test_released_before_its_load_lands_the_page_waits_then_stays_cached() -> None:
    kv = tiered_cache(num_pages=2, page_size=PS, host_slots=2)
    sim = TierSim(kv)
    computed(kv, sim, A).release()
    kv.writeback(max_pages=2)
    sim.finish_all()
    computed(kv, sim, B).release()
    hit = kv.match_prefix(A, 2)
    sim.take()
    hit.release()  # the request went away; the copies still write those pages
    assert kv.pool.num_allocatable == 0 and kv.stats().cached_unreferenced == 2
    kv.check_invariants()
    sim.finish_all()
    assert kv.pool.num_allocatable == 2
    check_contents(sim, page_tokens_by_hash([A, B], PS))


def test_eviction_without_a_host_copy_is_counted_as_a_drop() -> None:
    kv = tiered_cache(num_pages=2, page_size=PS, host_slots=2)
    sim = TierSim(kv)
    computed(kv, sim, A).release()
    computed(kv, sim, B).release()
    assert kv.counters.device_drops == 2
    assert kv.lookup(A, 2) == []


def test_write_back_follows_eviction_order_within_the_horizon() -> None:
    kv = tiered_cache(num_pages=4, page_size=PS, host_slots=4)
    sim = TierSim(kv)
    computed(kv, sim, A).release()  # LRU: a1, a0 (leaves first)
    order = kv.pool.eviction_order()
    assert kv.writeback(max_pages=8, horizon=1) == 1
    (op,) = sim.take()
    assert op.device_page == order[0]
    assert kv.writeback(max_pages=8, horizon=1) == 0, "the first page is being copied; the horizon ends there"
    assert kv.writeback(max_pages=8) == 1
    sim.finish_all()
    assert kv.writeback(max_pages=8) == 0, "nothing left that the host lacks"


def test_write_back_never_displaces_host_slots_protected_longer() -> None:
    clock = FakeClock()
    kv = tiered_cache(num_pages=2, page_size=PS, host_slots=1, clock=clock)
    sim = TierSim(kv)
    table = computed(kv, sim, A[:2])
    kv.retain(table, "s", ttl=50)
    table.release()
    kv.writeback(max_pages=1)
    sim.finish_all()
    computed(kv, sim, B).release()  # A's retained page is evicted from the device (it is on the host)
    assert kv.counters.retention_evictions == 1 and kv.counters.device_drops == 0
    assert kv.host is not None and kv.host.pool.num_retained == 1
    assert kv.writeback(max_pages=2) == 0, "unprotected pages may not evict a retained host slot"
    clock.now = 60  # the retention expired
    assert kv.writeback(max_pages=1) == 1
    sim.finish_all()
    kv.check_invariants()


def four_turns(kv: KVCache, sim: TierSim) -> list[list[int]]:
    """Four released 2-page prompts: 8 cached device pages, evicted in this order."""
    turns = [[10 * t + i for i in range(4)] for t in range(4)]
    for turn in turns:
        computed(kv, sim, turn).release()
    return turns


def host_copies_of(kv: KVCache, pages: list[int]) -> set[bytes]:
    assert kv.host is not None
    held = {kv.host.index.hash_of(slot) for slot in range(kv.host.pool.num_pages)}
    return {h for h in (kv.index.hash_of(page) for page in pages) if h in held}


def test_an_idle_cache_with_a_host_tier_smaller_than_its_cached_pages_stops_writing_back() -> None:
    """Issue 13: 8 cached device pages, 3 host slots, nothing running. Write-back used to evict the host
    copy of a page still cached on the device to copy another one, which the next batch copied back:
    3 copies a step forever. A copy only displaces a redundant copy of a page the device evicts later,
    so the host ends up holding the 3 pages the device evicts first, and then nothing moves."""
    kv = tiered_cache(num_pages=8, page_size=PS, host_slots=3)
    sim = TierSim(kv)
    four_turns(kv, sim)
    copies = []
    for _ in range(1000):
        copies.append(kv.writeback(max_pages=2))
        sim.finish_all()
        kv.check_invariants()
    assert sum(copies) == 3 and not any(copies[2:]), f"{sum(copies)} copies in 1000 idle steps"
    order = kv.pool.eviction_order()
    assert host_copies_of(kv, order[:3]) == {kv.index.hash_of(p) for p in order[:3]}
    computed(kv, sim, [90, 91, 92, 93]).release()  # the device evicts its 2 coldest pages: both saved
    assert kv.counters.device_drops == 0


def test_write_back_moves_host_copies_to_the_pages_the_device_evicts_next() -> None:
    """After hits reorder the device, the host copies of pages that are now evicted last give way to
    the new coldest pages (one copy each, no churn); unique host copies are not touched for that."""
    kv = tiered_cache(num_pages=8, page_size=PS, host_slots=3)
    sim = TierSim(kv)
    turns = four_turns(kv, sim)
    kv.writeback(max_pages=8)
    sim.finish_all()
    kv.match_prefix(turns[0], 2).release()  # the first turn is hit: the device now evicts it last
    order = kv.pool.eviction_order()
    assert kv.writeback(max_pages=8) == 2
    sim.finish_all()
    assert host_copies_of(kv, order[:3]) == {kv.index.hash_of(p) for p in order[:3]}
    assert kv.writeback(max_pages=8) == 0
    kv.check_invariants()


def test_write_back_gives_up_unique_host_copies_only_for_the_next_batch_of_evictions() -> None:
    """A host copy whose device page is gone is the only one left: write-back evicts it to copy a page
    the device will evict within the next batch, never to copy one further down the eviction order."""
    kv = tiered_cache(num_pages=4, page_size=PS, host_slots=2)
    sim = TierSim(kv)
    computed(kv, sim, A).release()
    kv.writeback(max_pages=2)
    sim.finish_all()
    computed(kv, sim, B).release()  # evicts A from the device: the host holds its only copy
    computed(kv, sim, [9, 9, 9, 9]).release()
    assert kv.counters.device_drops == 0 and kv.lookup(A, 2)[1].tier is Tier.HOST
    assert kv.writeback(max_pages=1) == 1  # the coldest device page may take a unique copy's slot
    sim.finish_all()
    assert [loc.tier for loc in kv.lookup(A, 2)] == [Tier.HOST]  # A's leaf (the host's LRU) went
    assert kv.writeback(max_pages=1) == 0, "the next page is beyond a batch of 1: A's first page stays"
    assert kv.writeback(max_pages=2) == 1  # within a batch of 2 it goes
    sim.finish_all()
    assert kv.lookup(A, 2) == []
    kv.check_invariants()


def test_an_idle_cache_with_a_disk_smaller_than_the_host_stops_writing_to_disk() -> None:
    """The same churn one tier down: 6 cached host slots, 2 disk files. Host -> disk write-back used to
    evict the file of a page the host still held to write another, then write that one back again:
    2 writes a step forever. A file of a page the host holds only gives way to a slot evicted sooner."""
    kv = tiered_cache(num_pages=8, page_size=PS, host_slots=6, disk_files=2)
    sim = TierSim(kv)
    four_turns(kv, sim)
    to_disk = []
    for _ in range(200):
        kv.writeback(max_pages=4, max_disk_pages=4)
        sim.finish_all()
        to_disk.append(kv.counters.pages_spilled_to_disk)
    assert kv.host is not None and kv.disk is not None
    assert to_disk[-1] == 2 and to_disk[2] == to_disk[-1], f"{to_disk[-1]} disk writes in 200 idle steps"
    coldest = kv.host.pool.eviction_order()[:2]
    assert all(kv.disk.contains(kv.host.index.hash_of(slot) or b"") for slot in coldest)
    kv.check_invariants()


def test_confirming_unknown_or_impossible_copies_raises_and_changes_nothing() -> None:
    kv = tiered_cache(num_pages=2, page_size=PS, host_slots=2)
    sim = TierSim(kv)
    computed(kv, sim, A).release()
    kv.writeback(max_pages=1)
    (op,) = sim.take()
    with pytest.raises(ValueError, match="cannot fail"):
        kv.complete(op.op_id, ok=False)
    with pytest.raises(UnknownCopy):
        kv.complete(op.op_id + 100)
    kv.check_invariants()
    sim.finish(op.op_id)
    with pytest.raises(UnknownCopy):
        kv.complete(op.op_id)
    kv.check_invariants()


def test_tier_stats_balance_on_every_tier() -> None:
    kv = tiered_cache(num_pages=4, page_size=PS, host_slots=3, disk_files=2)
    sim = TierSim(kv)
    table = computed(kv, sim, A)
    computed(kv, sim, B).release()
    kv.writeback(max_pages=1)
    stats = kv.tier_stats()
    assert stats.host is not None and stats.disk is not None
    for books in (stats.device, stats.host):
        assert books.free + books.owned + books.cached + books.draining == books.total
    assert stats.device.owned == 2 and stats.device.pinned == 1 and stats.host.pending == 1
    assert stats.copies_in_flight == 1 and stats.disk.files == 0
    sim.finish_all()
    kv.writeback(max_pages=0, max_disk_pages=2)
    sim.finish_all()
    stats = kv.tier_stats()
    assert stats.disk is not None and stats.disk.files == 1 and stats.disk.used_bytes == layout(PS).file_bytes
    assert stats.counters.pages_spilled == 1 and stats.counters.pages_spilled_to_disk == 1
    table.release()
    kv.check_invariants()


def test_without_tiers_no_copy_is_ever_made() -> None:
    kv = KVCache(num_pages=2, page_size=PS)
    table = kv.new_block_table()
    kv.allocate(table, 2)
    kv.publish(table, A, 4)
    table.release()
    assert kv.writeback(max_pages=8) == 0 and kv.prefetch(A, 2) == 0
    assert kv.take_copies() == [] and kv.tier_stats().host is None


def test_tier_config_is_validated() -> None:
    lay = layout(PS)
    with pytest.raises(ValueError, match="cannot hold one KV page"):
        KVCache(4, PS, tiers=KVTierConfig(lay, host_kv_cache_bytes=lay.bytes_per_page - 1))
    with pytest.raises(ValueError, match="page_size"):
        KVCache(4, PS + 1, tiers=KVTierConfig(lay, host_kv_cache_bytes=lay.bytes_per_page))
    with pytest.raises(ValueError, match="host_kv_cache_bytes"):
        KVCache(4, PS, tiers=KVTierConfig(lay, kv_cache_dir="/nonexistent", kv_cache_dir_bytes=10**6))
    with pytest.raises(ValueError, match="session_ttl"):
        KVCache(4, PS, tiers=KVTierConfig(lay, session_ttl=-1))
    kv = KVCache(4, PS, tiers=KVTierConfig(lay, host_kv_cache_bytes=10 * lay.bytes_per_page + 3))
    assert kv.host is not None and kv.host.pool.num_pages == 10
