"""Session-aware retention: soft priority by expiry, TTL on a fake clock, never blocking (no scheduler)."""

from __future__ import annotations

import pytest

from tests.kv_tier_sim import FakeClock, TierSim, tiered_cache
from tokenspeed.kvcache import BlockTable, KVCache, PageRefError

PS = 1


def one_page(kv: KVCache, token: int) -> BlockTable:
    """A table holding one computed, published page."""
    table = kv.new_block_table()
    kv.allocate(table, 1)
    kv.publish(table, [token], 1)
    return table


def finish(kv: KVCache, token: int, session: str | None = None, ttl: float | None = None) -> int:
    """A finished one-page turn (retained for `session`), released; its page."""
    table = one_page(kv, token)
    page = table.page_at(0)
    if session is not None:
        assert kv.retain(table, session, ttl) == 1
    table.release()
    return page


def test_unprotected_pages_go_first_then_retained_ones_by_expiry() -> None:
    clock = FakeClock()
    kv = KVCache(4, PS, clock=clock)
    late = finish(kv, 1, "s1", ttl=20)
    early = finish(kv, 2, "s2", ttl=10)
    plain = finish(kv, 3)
    assert kv.pool.eviction_order() == [plain, early, late]
    grab = kv.new_block_table()
    kv.allocate(grab, 1)  # the free page
    kv.allocate(grab, 1)
    assert grab.page_at(1) == plain
    kv.allocate(grab, 1)
    assert grab.page_at(2) == early
    assert kv.pool.eviction_order() == [late]
    grab.release()
    kv.check_invariants()


def test_expired_retention_makes_the_page_the_coldest() -> None:
    clock = FakeClock()
    kv = KVCache(3, PS, clock=clock)
    kept = finish(kv, 1, "s", ttl=5)
    plain = finish(kv, 2)
    assert kv.pool.eviction_order() == [plain, kept]
    clock.now = 5.0  # expiry is inclusive: protected strictly before `until`
    assert kv.pool.eviction_order() == [kept, plain]
    assert kv.pool.retention(kept) is None and kv.pool.num_retained == 0
    kv.check_invariants()


def test_retention_is_soft_an_all_retained_pool_still_allocates() -> None:
    kv = KVCache(3, PS, clock=FakeClock())
    for token in range(3):
        finish(kv, token, f"s{token}", ttl=100)
    assert kv.pool.num_retained == 3 and kv.can_allocate(3)
    grab = kv.new_block_table()
    kv.allocate(grab, 3)
    assert kv.stats().indexed == 0
    grab.release()
    kv.check_invariants()


def test_retention_counts_evictions_before_expiry_only() -> None:
    clock = FakeClock()
    kv = tiered_cache(2, PS, host_slots=1, clock=clock)
    finish(kv, 1, "s", ttl=5)
    finish(kv, 2, "s", ttl=50)
    clock.now = 10
    grab = kv.new_block_table()
    kv.allocate(grab, 2)
    assert kv.counters.retention_evictions == 1, "the expired page was an ordinary eviction"
    assert kv.counters.device_drops == 2, "neither page had been written back"
    grab.release()


def test_a_referenced_page_takes_its_retention_when_released() -> None:
    clock = FakeClock()
    kv = KVCache(3, PS, clock=clock)
    table = one_page(kv, 7)
    page = table.page_at(0)
    kv.retain(table, "s", ttl=10)
    kv.retain(table, "s", ttl=4)  # a shorter retention never shortens a longer one
    assert kv.pool.retention(page) == ("s", 10.0)
    clock.now = 3
    kv.retain(table, "t", ttl=30)
    assert kv.pool.retention(page) == ("t", 33.0)
    clock.now = 40  # expired while referenced: released as an ordinary cached page
    table.release()
    assert kv.pool.num_retained == 0 and kv.pool.eviction_order() == [page]
    kv.check_invariants()


def test_a_hit_on_a_retained_page_keeps_its_protection_after_release() -> None:
    clock = FakeClock()
    kv = KVCache(3, PS, clock=clock)
    page = finish(kv, 7, "s", ttl=10)
    hit = kv.match_prefix([7, 8], 1)
    assert hit.pages == [page] and kv.pool.num_retained == 0
    hit.release()
    assert kv.pool.num_retained == 1
    kv.check_invariants()


def test_retain_bounds_to_the_cacheable_prefix_and_skips_unindexed_pages() -> None:
    kv = KVCache(6, PS, clock=FakeClock())
    table = kv.new_block_table()
    kv.allocate(table, 3)
    kv.publish(table, [1, 2, 3], 2)  # page 2 not computed, not indexed
    assert kv.retain(table, "s", num_pages=1) == 1
    assert kv.retain(table, "s") == 2
    duplicate = kv.new_block_table()
    kv.allocate(duplicate, 1)
    kv.publish(duplicate, [1], 1)  # same hash as table's page 0: hashed, not indexed
    assert kv.retain(duplicate, "s") == 0
    with pytest.raises(PageRefError):
        kv.pool.retain(duplicate.page_at(0), "s", 5.0)
    table.release()
    duplicate.release()
    kv.check_invariants()


def test_retained_pages_spill_to_the_host_with_their_protection() -> None:
    clock = FakeClock()
    kv = tiered_cache(2, PS, host_slots=2, clock=clock)
    sim = TierSim(kv)
    retained = one_page(kv, 1)
    sim.device[retained.page_at(0)] = [1]
    kv.retain(retained, "agent", ttl=100)
    retained.release()
    plain = one_page(kv, 2)
    sim.device[plain.page_at(0)] = [2]
    plain.release()
    assert kv.writeback(max_pages=2) == 2  # the unprotected page first, then the retained one
    sim.finish_all()
    host = kv.host
    assert host is not None and host.pool.num_retained == 1
    slot = host.index.lookup(kv.index.hash_of(kv.pool.eviction_order()[1]) or b"")
    assert slot is not None and host.pool.retention(slot) == ("agent", 100.0)
    assert host.pool.eviction_order()[-1] == slot, "the host evicts the retained copy last"
    kv.check_invariants()
