"""Prefix-cache page events (`kvcache/events.py`) and their relay to a router (`grpc/kv_events.py`).

The log is off by default and must then record nothing; on, a published
prompt is one `PagesStored` run (hashes chained from the parent, `page_size`
tokens per page), a page another request already indexed splits the run,
and evicting cached pages is one `PagesRemoved`. The relay mirrors the live
pages so a late subscriber gets a snapshot (parents first) numbered so that
live batches follow without a gap, resumes from its history when it can,
and ends a subscriber that falls behind.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from tokenspeed.grpc.kv_events import KvEventRelay, block_hash64
from tokenspeed.kvcache import KVCache, PagesRemoved, PagesStored, chain_hash

PAGE = 4


def _publish(kv: KVCache, tokens: list[int]):
    table = kv.new_block_table()
    kv.allocate(table, kv.pages_for(len(tokens)))
    kv.publish(table, tokens, len(tokens))
    return table


def test_log_is_off_by_default_and_records_runs_when_on():
    kv = KVCache(num_pages=8, page_size=PAGE)
    _publish(kv, list(range(8))).release()
    assert kv.events.drain() == []

    kv = KVCache(num_pages=8, page_size=PAGE)
    kv.events.enabled = True
    tokens = list(range(10))  # 2 full pages and a partial one
    table = _publish(kv, tokens)
    (stored,) = kv.events.drain()
    first = chain_hash(None, tokens[:4])
    assert stored == PagesStored(None, [first, chain_hash(first, tokens[4:8])], tokens[:8])
    table.release()
    assert kv.events.drain() == []  # releasing keeps the pages cached: nothing removed


def test_a_page_indexed_elsewhere_splits_the_run():
    kv = KVCache(num_pages=8, page_size=PAGE)
    kv.events.enabled = True
    one = _publish(kv, [1, 2, 3, 4])
    kv.events.drain()
    two = _publish(kv, [1, 2, 3, 4, 5, 6, 7, 8])  # computed its own copy of page 0 (no match_prefix)
    (stored,) = kv.events.drain()
    first = chain_hash(None, [1, 2, 3, 4])
    assert stored == PagesStored(first, [chain_hash(first, [5, 6, 7, 8])], [5, 6, 7, 8])
    one.release()
    two.release()


def test_eviction_is_one_removed_record():
    kv = KVCache(num_pages=4, page_size=PAGE)
    kv.events.enabled = True
    _publish(kv, list(range(8))).release()
    (stored,) = kv.events.drain()
    fresh = kv.new_block_table()
    kv.allocate(fresh, 4)  # 2 free pages, then the 2 cached ones are evicted
    (removed,) = kv.events.drain()
    assert isinstance(removed, PagesRemoved) and sorted(removed.page_hashes) == sorted(stored.page_hashes)
    fresh.release()
    kv.check_invariants()


class _Context:
    async def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


def _relay(**options) -> KvEventRelay:
    return KvEventRelay(PAGE, lambda: common_pb2.EngineLoad(running_requests=1), **options)


def _stored(parent: bytes | None, *pages: list[int]) -> tuple[PagesStored, list[bytes]]:
    hashes, tokens = [], []
    for page in pages:
        parent_hash = hashes[-1] if hashes else parent
        hashes.append(chain_hash(parent_hash, page))
        tokens += page
    return PagesStored(parent, hashes, tokens), hashes


async def _take(stream, n: int) -> list[common_pb2.KvEventBatch]:
    return [await asyncio.wait_for(stream.__anext__(), 2) for _ in range(n)]


def test_snapshot_parents_first_then_live_without_gap():
    async def run() -> None:
        relay = _relay(heartbeat_s=0.05)
        root, hashes = _stored(None, [1, 2, 3, 4], [5, 6, 7, 8])
        relay.publish([root])
        child, child_hashes = _stored(hashes[1], [9, 9, 9, 9])
        relay.publish([child, PagesRemoved([hashes[0]])])  # parent evicted, child still cached
        stream = relay.subscribe(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True),
                                 _Context())
        heartbeat, snapshot = await _take(stream, 2)
        assert heartbeat.sequence_number == 0 and heartbeat.load.load_only
        assert snapshot.sequence_number == relay.sequence == 2 and snapshot.snapshot.count == 1
        kinds = [e.WhichOneof("data") for e in snapshot.events]
        assert kinds == ["cleared", "stored", "stored"]
        order = [e.stored.blocks[0].block_hash for e in snapshot.events[1:]]
        assert order == [block_hash64(hashes[1]), block_hash64(child_hashes[0])]  # parent before child
        assert snapshot.events[2].stored.parent_block_hash == block_hash64(hashes[1])
        (idle,) = await _take(stream, 1)
        assert idle.load.load_only and idle.sequence_number == 2 and not idle.events
        relay.publish([PagesRemoved(child_hashes)])
        (live,) = await _take(stream, 1)
        assert live.sequence_number == 3 and live.events[0].removed.block_hashes == [block_hash64(child_hashes[0])]
        assert not live.load.load_only and live.load.running_requests == 1
        await stream.aclose()

    asyncio.run(run())


def test_resume_from_history_or_snapshot():
    async def run() -> None:
        relay = _relay(history=2)
        for i in range(4):
            relay.publish([_stored(None, [i] * PAGE)[0]])
        resumed = relay.subscribe(common_pb2.SubscribeKvEventsRequest(start_sequence_number=3), _Context())
        assert [b.sequence_number for b in await _take(resumed, 2)] == [3, 4]
        await resumed.aclose()
        too_old = relay.subscribe(common_pb2.SubscribeKvEventsRequest(start_sequence_number=1), _Context())
        (snapshot,) = await _take(too_old, 1)
        assert snapshot.HasField("snapshot") and len(snapshot.events) == 5  # cleared + 4 pages
        await too_old.aclose()

    asyncio.run(run())


def test_a_lagging_subscriber_is_ended():
    async def run() -> None:
        relay = _relay(max_lag=2)
        stream = relay.subscribe(common_pb2.SubscribeKvEventsRequest(), _Context())
        relay.publish([])
        (first,) = await _take(stream, 1)
        for _ in range(4):
            relay.publish([])
        with pytest.raises(RuntimeError, match=str(grpc.StatusCode.RESOURCE_EXHAUSTED)):
            await _take(stream, 4)

    asyncio.run(run())
