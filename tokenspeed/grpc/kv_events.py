"""`SubscribeKvEvents`: the replica's prefix-cache page events, streamed to a cache-aware router.

The engine core records which full pages its prefix index gains and loses
(`kvcache/events.py`); they reach this process with each step's outputs
(`AsyncEngine.on_kv_events`). `KvEventRelay` numbers them as batches
(`sequence_number` 1, 2, ...), fans them out to every subscriber, and keeps
two things so that a router that (re)subscribes late still learns the whole
state:

* a mirror of the live pages (hash -> parent hash, tokens), sent as a state
  snapshot (an `AllBlocksCleared` then one `Stored` per page, parents
  first) to a subscriber with no usable cursor;
* the last `history` batches, replayed to a subscriber that resumes from a
  sequence number they still cover.

Every batch carries the replica's load record, and an idle stream sends a
`load_only` batch every `heartbeat_s`: the router counts each record as
contact, and excludes a replica whose records stop (a dead replica leaves
the rotation within seconds even before a request fails on it). A
subscriber that falls `max_lag` batches behind is ended (`RESOURCE_EXHAUSTED`)
rather than buffered without bound; it resubscribes and gets a snapshot.

Page hashes are our 16-byte chained blake2b digests (`kvcache/prefix_index.py`)
cut to their first 8 bytes as a signed int64, the proto's `block_hash`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from smg_grpc_proto.generated import common_pb2

from tokenspeed.kvcache.events import KVEvent, PagesStored

_SNAPSHOT_CHUNK_BLOCKS = 4096


def block_hash64(page_hash: bytes) -> int:
    return int.from_bytes(page_hash[:8], "big", signed=True)


@dataclass(slots=True)
class _LivePage:
    parent: int | None
    token_ids: list[int]


class _Lagging(Exception):
    """A subscriber's queue is full: it is ended and must resubscribe."""


class KvEventRelay:
    def __init__(
        self,
        page_size: int,
        load: Callable[[], common_pb2.EngineLoad],
        *,
        history: int = 1024,
        heartbeat_s: float = 1.0,
        max_lag: int = 4096,
    ) -> None:
        self.page_size = page_size
        self._load = load
        self.heartbeat_s = heartbeat_s
        self.max_lag = max_lag
        self.sequence = 0  # of the last batch published
        self._event_id = 0
        self._live: dict[int, _LivePage] = {}
        self._history: deque[common_pb2.KvEventBatch] = deque(maxlen=history)
        self._subscribers: set[asyncio.Queue[common_pb2.KvEventBatch | None]] = set()

    @property
    def num_live_pages(self) -> int:
        return len(self._live)

    # ---- the engine's side ---------------------------------------------------------------

    def publish(self, events: list[KVEvent]) -> None:
        """One step's records: mirror them, number them as one batch, hand it to every subscriber."""
        proto_events = [self._apply(event) for event in events]
        self.sequence += 1
        batch = common_pb2.KvEventBatch(
            sequence_number=self.sequence, timestamp=time.time(), events=proto_events, dp_rank=0
        )
        self._history.append(batch)
        for queue in list(self._subscribers):
            if queue.qsize() >= self.max_lag:
                self._subscribers.discard(queue)
                queue.put_nowait(None)  # the subscriber's stream ends as lagging
            else:
                queue.put_nowait(batch)

    def _next_event_id(self) -> int:
        self._event_id += 1
        return self._event_id

    def _apply(self, event: KVEvent) -> common_pb2.KvCacheEvent:
        if isinstance(event, PagesStored):
            parent = None if event.parent_hash is None else block_hash64(event.parent_hash)
            blocks = []
            for i, page_hash in enumerate(event.page_hashes):
                tokens = event.token_ids[i * self.page_size : (i + 1) * self.page_size]
                key = block_hash64(page_hash)
                self._live[key] = _LivePage(parent, tokens)
                blocks.append(common_pb2.KvBlock(block_hash=key, token_ids=tokens, block_size=self.page_size))
                parent = key
            stored = common_pb2.KvBlocksStored(blocks=blocks)
            first_parent = self._live[blocks[0].block_hash].parent if blocks else None
            if first_parent is not None:
                stored.parent_block_hash = first_parent
            return common_pb2.KvCacheEvent(event_id=self._next_event_id(), stored=stored)
        hashes = [block_hash64(h) for h in event.page_hashes]
        for key in hashes:
            self._live.pop(key, None)
        return common_pb2.KvCacheEvent(
            event_id=self._next_event_id(), removed=common_pb2.KvBlocksRemoved(block_hashes=hashes)
        )

    # ---- the router's side ---------------------------------------------------------------

    def _snapshot(self) -> list[common_pb2.KvCacheEvent]:
        """Cleared, then every live page as one `Stored` (parents before children)."""
        events = [common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())]
        emitted: set[int] = set()

        def emit(key: int) -> None:
            chain = []
            while key not in emitted and key in self._live:  # walk up to an emitted or unknown parent
                chain.append(key)
                emitted.add(key)
                parent = self._live[key].parent
                if parent is None:
                    break
                key = parent
            for item in reversed(chain):
                page = self._live[item]
                stored = common_pb2.KvBlocksStored(
                    blocks=[common_pb2.KvBlock(block_hash=item, token_ids=page.token_ids, block_size=self.page_size)]
                )
                if page.parent is not None:
                    stored.parent_block_hash = page.parent
                events.append(common_pb2.KvCacheEvent(stored=stored))

        for key in list(self._live):
            emit(key)
        return events

    def _snapshot_batches(self) -> list[common_pb2.KvEventBatch]:
        """The state as chunks numbered so that the last is the current sequence (no gap after it)."""
        events = self._snapshot()
        per_chunk = max(_SNAPSHOT_CHUNK_BLOCKS, -(-len(events) // self.sequence))
        chunks = [events[i : i + per_chunk] for i in range(0, len(events), per_chunk)]
        first = self.sequence - len(chunks) + 1
        return [
            common_pb2.KvEventBatch(
                sequence_number=first + i,
                timestamp=time.time(),
                events=chunk,
                dp_rank=0,
                snapshot=common_pb2.KvSnapshotChunk(
                    index=i, count=len(chunks), blocks=len(self._live), unknown_before=0
                ),
            )
            for i, chunk in enumerate(chunks)
        ]

    def _catch_up(self, start: int) -> list[common_pb2.KvEventBatch]:
        """What a subscriber asking to resume at `start` gets before live batches."""
        if self.sequence == 0:
            return []
        oldest = self._history[0].sequence_number if self._history else self.sequence + 1
        if start > 0 and oldest <= start <= self.sequence + 1:
            return [b for b in self._history if b.sequence_number >= start]
        return self._snapshot_batches()

    async def subscribe(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        queue: asyncio.Queue[common_pb2.KvEventBatch | None] = asyncio.Queue()
        self._subscribers.add(queue)  # before the catch-up: nothing published meanwhile is missed
        sample = 0

        def with_load(batch: common_pb2.KvEventBatch, load_only: bool = False) -> common_pb2.KvEventBatch:
            nonlocal sample
            sample += 1
            record = self._load()
            record.sample, record.load_only = sample, load_only
            batch.load.CopyFrom(record)
            return batch

        def heartbeat(sequence: int) -> common_pb2.KvEventBatch:
            return with_load(
                common_pb2.KvEventBatch(sequence_number=sequence, timestamp=time.time(), dp_rank=0), True
            )

        try:
            if request.load_records_before_first_batch:
                yield heartbeat(0)
            sent = self.sequence  # the catch-up ends here; later batches are in the queue
            for batch in self._catch_up(request.start_sequence_number):
                yield with_load(self._copy(batch))
            while True:
                try:
                    batch = await asyncio.wait_for(queue.get(), self.heartbeat_s)
                except TimeoutError:
                    yield heartbeat(sent)
                    continue
                if batch is None:
                    raise _Lagging
                if batch.sequence_number <= sent:
                    continue  # covered by the catch-up
                sent = batch.sequence_number
                yield with_load(self._copy(batch))
        except _Lagging:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "KV event subscriber fell behind; resubscribe for a snapshot"
            )
        finally:
            self._subscribers.discard(queue)

    @staticmethod
    def _copy(batch: common_pb2.KvEventBatch) -> common_pb2.KvEventBatch:
        """Batches are shared by subscribers; each stream stamps its own load record on a copy."""
        copy = common_pb2.KvEventBatch()
        copy.CopyFrom(batch)
        return copy
