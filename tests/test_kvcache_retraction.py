"""Partial retraction: private pages to the host, shared ones stay; restore and its fallbacks (no scheduler)."""

from __future__ import annotations

import pytest

from tests.kv_tier_sim import TierSim, check_contents, page_tokens_by_hash, run_prompt, tiered_cache
from tokenspeed.kvcache import BlockTable, CopyKind, KVCache, KVCacheError, StaleBlockTable

PS = 2
PROMPT = [1, 2, 3, 4, 5, 6, 7]  # pages [1,2] [3,4] [5,6] full, [7] partial


def run(kv: KVCache, sim: TierSim, tokens: list[int], *, match: bool = True) -> BlockTable:
    """A running request with every token of `tokens` computed and its full pages published."""
    return run_prompt(kv, sim, tokens, (len(tokens) - 1) // PS if match else 0)


def resume(kv: KVCache, sim: TierSim, tokens: list[int], table: BlockTable, computed: int) -> None:
    """Land the restore's copies, recompute what was lost, and check the KV reads back the history."""
    sim.finish_all()
    assert kv.is_ready(table)
    kv.allocate(table, kv.pages_for(len(tokens)) - len(table))
    sim.compute(table.pages, tokens, computed, len(tokens))


def test_only_private_pages_move_and_restore_brings_everything_back() -> None:
    kv = tiered_cache(num_pages=8, page_size=PS, host_slots=4)
    sim = TierSim(kv)
    sibling = run(kv, sim, PROMPT[:4])  # shares pages 0-1 with the victim
    victim = run(kv, sim, PROMPT)  # page 2 published (cache only), page 3 private
    private_page = victim.page_at(3)
    retraction = kv.retract(victim, num_computed_tokens=7)
    assert victim.is_consumed and retraction.shared == [True, True, True, False]
    assert retraction.bytes_moved == kv.bytes_per_page and retraction.bytes_full == 4 * kv.bytes_per_page
    (op,) = sim.take()
    assert op.kind is CopyKind.DEVICE_TO_HOST and op.device_page == private_page
    assert kv.stats().draining == 1, "the private page drains until its copy is confirmed"
    assert not kv.is_restorable(retraction)
    with pytest.raises(KVCacheError, match="landed"):
        kv.restore(retraction)
    kv.check_invariants()
    sim.finish_all()
    assert kv.stats().draining == 0 and kv.is_restorable(retraction)
    assert kv.pages_to_restore(retraction) == 1
    restored = kv.restore(retraction)
    assert (restored.pages_reacquired, restored.pages_loaded, restored.num_computed_tokens) == (3, 1, 7)
    assert restored.table.num_published == 3
    resume(kv, sim, PROMPT + [8], restored.table, 7)
    counters = kv.counters
    assert (counters.pages_retracted, counters.pages_retracted_full, counters.pages_restored) == (1, 4, 1)
    with pytest.raises(StaleBlockTable):
        kv.restore(retraction)
    restored.table.release()
    sibling.release()
    kv.check_invariants()


def test_with_caching_off_every_computed_page_moves() -> None:
    kv = tiered_cache(num_pages=4, page_size=PS, host_slots=4, caching=False)
    sim = TierSim(kv)
    victim = run(kv, sim, PROMPT, match=False)
    retraction = kv.retract(victim, num_computed_tokens=5)  # page 3 holds nothing computed
    assert retraction.shared == [False, False, False] and retraction.bytes_moved == retraction.bytes_full
    sim.finish_all()
    assert kv.stats().free == 4
    other = run(kv, sim, [9] * 8, match=False)  # overwrites every device page
    other.release()
    restored = kv.restore(retraction)
    assert restored.num_computed_tokens == 5 and restored.pages_loaded == 3
    resume(kv, sim, PROMPT, restored.table, 5)
    restored.table.release()
    kv.check_invariants()


def test_an_evicted_shared_page_comes_back_from_the_host_or_is_recomputed() -> None:
    for backed in (True, False):
        kv = tiered_cache(num_pages=4, page_size=PS, host_slots=4)
        sim = TierSim(kv)
        retraction = kv.retract(run(kv, sim, PROMPT), num_computed_tokens=7)
        sim.finish_all()
        if backed:
            kv.writeback(max_pages=8)
            sim.finish_all()
        run(kv, sim, [9] * 8, match=False).release()  # evicts the victim's published pages
        restored = kv.restore(retraction)
        if backed:
            assert restored.pages_loaded == 4 and restored.num_computed_tokens == 7
        else:  # page 0 is gone: everything from it is recomputed, the private copy is dropped
            assert len(restored.table) == 0 and restored.num_computed_tokens == 0
        resume(kv, sim, PROMPT, restored.table, restored.num_computed_tokens)
        check_contents(sim, page_tokens_by_hash([PROMPT], PS))
        restored.table.release()
        sim.finish_all()
        kv.check_invariants()
        host_books = kv.tier_stats().host
        assert host_books is not None and host_books.owned == 0


def test_a_full_host_saves_a_prefix_of_the_private_pages() -> None:
    kv = tiered_cache(num_pages=4, page_size=PS, host_slots=1, caching=False)
    sim = TierSim(kv)
    retraction = kv.retract(run(kv, sim, PROMPT, match=False), num_computed_tokens=7)
    assert retraction.shared == [False] and retraction.num_computed_tokens == PS
    assert kv.counters.pages_retract_lost == 3
    sim.finish_all()
    restored = kv.restore(retraction)
    resume(kv, sim, PROMPT, restored.table, restored.num_computed_tokens)
    restored.table.release()
    kv.check_invariants()


def test_without_a_host_tier_retraction_keeps_only_what_the_device_caches() -> None:
    kv = KVCache(4, PS)
    sim = TierSim(kv)
    retraction = kv.retract(run(kv, sim, PROMPT), num_computed_tokens=7)
    assert retraction.shared == [True, True, True] and retraction.bytes_moved == 0
    assert kv.take_copies() == []
    restored = kv.restore(retraction)
    assert restored.num_computed_tokens == 6 and restored.pages_reacquired == 3
    resume(kv, sim, PROMPT, restored.table, 6)
    restored.table.release()
    kv.check_invariants()


def test_discard_frees_the_host_copies_once_they_land() -> None:
    kv = tiered_cache(num_pages=4, page_size=PS, host_slots=4, caching=False)
    sim = TierSim(kv)
    retraction = kv.retract(run(kv, sim, PROMPT, match=False), num_computed_tokens=7)
    retraction.discard()  # aborted while its copies are still in flight
    host = kv.host
    assert host is not None and host.pool.num_draining == 4 and host.pool.num_referenced == 0
    kv.check_invariants()
    sim.finish_all()
    assert host.pool.num_free == 4 and kv.stats().free == 4
    with pytest.raises(StaleBlockTable):
        retraction.discard()
    kv.check_invariants()


def test_retracting_right_after_a_restore_keeps_what_has_landed() -> None:
    kv = tiered_cache(num_pages=4, page_size=PS, host_slots=4, caching=False)
    sim = TierSim(kv)
    retraction = kv.retract(run(kv, sim, PROMPT, match=False), num_computed_tokens=7)
    sim.finish_all()
    restored = kv.restore(retraction)
    sim.take()  # the loads are running
    again = kv.retract(restored.table, restored.num_computed_tokens)
    assert again.num_pages == 0 and again.num_computed_tokens == 0, "pages still loading cannot be copied out"
    sim.finish_all()
    kv.check_invariants()
    assert kv.stats().free == 4
    again.discard()
