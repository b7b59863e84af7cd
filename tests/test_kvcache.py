"""Page pool, ownership handles and the chained-hash prefix index (no scheduler)."""

from __future__ import annotations

import gc

import pytest

from tokenspeed.kvcache import (
    BlockTable,
    KVCache,
    OutOfPages,
    PageRefError,
    StaleBlockTable,
    chain_hash,
)

PS = 4


def filled(kv: KVCache, tokens: list[int]) -> BlockTable:
    """A table holding computed, published pages for `tokens` (as a finished prefill would)."""
    table = kv.new_block_table()
    kv.allocate(table, kv.pages_for(len(tokens)))
    kv.publish(table, tokens, len(tokens))
    return table


def test_allocate_is_all_or_nothing_and_accounted() -> None:
    kv = KVCache(num_pages=5, page_size=PS)
    table = kv.new_block_table()
    assert kv.allocate(table, 3) == table.pages
    assert kv.stats().free == 2 and kv.stats().referenced == 3
    assert not kv.can_allocate(3)
    other = kv.new_block_table()
    with pytest.raises(OutOfPages) as err:
        kv.allocate(other, 3)
    assert err.value.requested == 3 and err.value.available == 2
    assert len(other) == 0 and kv.stats().free == 2
    kv.check_invariants()
    table.release()
    other.release()
    assert kv.stats() == kv.stats().__class__(total=5, free=5, referenced=0, cached_unreferenced=0, indexed=0)
    kv.check_invariants()


def test_moved_or_released_table_raises_on_any_use() -> None:
    kv = KVCache(num_pages=4, page_size=PS)
    old = kv.new_block_table()
    kv.allocate(old, 2)
    pages = old.pages
    new = old.move()
    assert new.pages == pages and old.is_consumed
    for use in (lambda: old.pages, lambda: len(old), old.release, old.move, lambda: old.page_at(0),
                lambda: kv.allocate(old, 1), lambda: kv.publish(old, [1] * 8, 8)):
        with pytest.raises(StaleBlockTable, match="move"):
            use()
    new.release()
    with pytest.raises(StaleBlockTable, match="release"):
        new.release()
    assert kv.stats().free == 4
    kv.check_invariants()


def test_chained_hash_depends_on_the_whole_prefix() -> None:
    page = [5, 6, 7, 8]
    root = chain_hash(None, page)
    assert root == chain_hash(None, list(page)) and len(root) == 16
    assert chain_hash(root, page) != root
    assert chain_hash(chain_hash(None, [1, 2, 3, 4]), page) != chain_hash(chain_hash(None, [1, 2, 3, 9]), page)


def test_match_returns_full_published_pages_only_and_respects_max_pages() -> None:
    kv = KVCache(num_pages=8, page_size=PS)
    tokens = list(range(10))  # 2 full pages + a partial one
    table = filled(kv, tokens)
    assert table.num_published == 2
    hit = kv.match_prefix(tokens + [99], max_pages=10)
    assert hit.pages == table.pages[:2] and hit.num_published == 2
    assert kv.pool.refcount(table.page_at(0)) == 2
    one = kv.match_prefix(tokens, max_pages=1)
    assert one.pages == table.pages[:1]
    diverged = kv.match_prefix([0, 1, 2, 3, 4, 5, 6, 0], max_pages=10)
    assert diverged.pages == table.pages[:1]
    for t in (table, hit, one, diverged):
        t.release()
    kv.check_invariants()


def test_publish_is_incremental_and_skips_uncomputed_pages() -> None:
    kv = KVCache(num_pages=8, page_size=PS)
    tokens = list(range(12))
    table = kv.new_block_table()
    kv.allocate(table, 3)
    assert kv.publish(table, tokens, num_computed_tokens=3) == 0
    assert kv.publish(table, tokens, num_computed_tokens=9) == 2
    assert kv.publish(table, tokens, num_computed_tokens=9) == 0
    assert kv.publish(table, tokens, num_computed_tokens=12) == 1
    assert kv.stats().indexed == 3
    matched = kv.match_prefix(tokens + [0], max_pages=3)
    assert matched.pages == table.pages
    matched.release()
    table.release()
    assert kv.stats().cached_unreferenced == 3 and kv.stats().free == 5
    kv.check_invariants()


def test_released_cached_pages_are_evicted_leaves_first_after_free_pages() -> None:
    kv = KVCache(num_pages=6, page_size=PS)
    first = filled(kv, list(range(8)))  # pages a0, a1
    second = filled(kv, list(range(100, 108)))  # pages b0, b1
    a0, a1 = first.pages
    b0, b1 = second.pages
    first.release()  # LRU: a1, a0 (leaf first)
    second.release()  # LRU: a1, a0, b1, b0
    assert kv.pool.eviction_order() == [a1, a0, b1, b0]
    grab = kv.new_block_table()
    kv.allocate(grab, 2)  # the two never-used pages come first
    assert not set(grab.pages) & {a0, a1, b0, b1}
    assert kv.stats().indexed == 4
    kv.allocate(grab, 1)  # now the oldest leaf is evicted
    assert grab.page_at(2) == a1 and kv.stats().indexed == 3
    # The root of the first prefix is still cached: a partial match survives.
    hit = kv.match_prefix(list(range(8)), max_pages=2)
    assert hit.pages == [a0]
    assert kv.pool.eviction_order() == [b1, b0]  # the hit took a0 out of the LRU
    hit.release()
    assert kv.pool.eviction_order() == [b1, b0, a0]
    grab.release()
    kv.check_invariants()


def test_duplicate_page_keeps_first_mapping_and_frees_the_second() -> None:
    kv = KVCache(num_pages=6, page_size=PS)
    tokens = list(range(8))
    first = filled(kv, tokens)
    second = filled(kv, tokens)  # computed concurrently: same hashes, other pages
    assert second.num_published == 2  # the chain goes on even though nothing was indexed
    assert kv.stats().indexed == 2
    assert kv.index.lookup(chain_hash(None, tokens[:4])) == first.page_at(0)
    second.release()
    assert kv.stats().free == 4 and kv.stats().cached_unreferenced == 0
    first.release()
    assert kv.stats().cached_unreferenced == 2
    kv.check_invariants()


def test_disabled_prefix_caching_indexes_nothing() -> None:
    kv = KVCache(num_pages=4, page_size=PS, enable_prefix_caching=False)
    table = filled(kv, list(range(8)))
    assert kv.stats().indexed == 0 and table.num_published == 0
    assert len(kv.match_prefix(list(range(9)), max_pages=2)) == 0
    table.release()
    assert kv.stats().free == 4
    kv.check_invariants()


def test_invariant_check_catches_leaks_and_double_frees() -> None:
    kv = KVCache(num_pages=4, page_size=PS)
    table = kv.new_block_table()
    kv.allocate(table, 2)
    page = table.page_at(0)
    del table
    gc.collect()
    with pytest.raises(AssertionError, match="live BlockTables hold it"):
        kv.check_invariants()
    kv.pool.decref(page)
    with pytest.raises(PageRefError):
        kv.pool.decref(page)
    with pytest.raises(PageRefError):
        kv.pool.incref(page)  # a free page can only be handed out by allocate()


def test_invariant_check_catches_corrupted_books() -> None:
    kv = KVCache(num_pages=4, page_size=PS)
    kv.pool._free.append(0)  # page 0 listed free twice
    with pytest.raises(AssertionError, match="twice"):
        kv.check_invariants()
    kv = KVCache(num_pages=4, page_size=PS)
    kv.pool._refcount[1] = -1
    with pytest.raises(AssertionError, match="negative"):
        kv.check_invariants()
