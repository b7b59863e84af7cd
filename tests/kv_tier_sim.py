"""A simulated executor for the KV tiers: page contents, copies run in any order, a fake clock and disk.

Like `SimulatedExecutor`, a page's "KV" is the token id written at each of its
slots. Copies are run the way a real device would run them, as badly as it
is allowed to: when the executor takes a copy its destination is filled with
`POISON` (the bytes are garbage until the copy lands), and the source is only
read when the copy is confirmed (an asynchronous copy may read it any time
until then). So reading a page before its copy landed, or reusing a page a
copy still reads, shows up as wrong tokens in the content checks rather than
passing by luck. Disk copies go through the real page-file format
(`DiskTier.write_payload` / `read_payload`) on an in-memory store.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenspeed.kvcache import BlockTable, CopyKind, CopyOp, KVCache, KVLayout, KVTierConfig, StoredFile
from tokenspeed.kvcache.page_file import page_file_name
from tokenspeed.kvcache.prefix_index import chain_hash

POISON = -1
Slots = list[list[int]]


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class MemoryStore:
    """`PageFileStore` in a dict (deep-copyable, so the model checker can branch on it)."""

    files: dict[str, bytes] = field(default_factory=dict)
    mtimes: dict[str, float] = field(default_factory=dict)
    writes: int = 0

    def write(self, name: str, parts: Sequence[bytes | memoryview]) -> None:
        self.files[name] = b"".join(bytes(p) for p in parts)
        self.writes += 1
        self.mtimes[name] = float(self.writes)

    def read(self, name: str) -> bytes | None:
        return self.files.get(name)

    def delete(self, name: str) -> None:
        self.files.pop(name, None)
        self.mtimes.pop(name, None)

    def list(self) -> list[StoredFile]:
        return [StoredFile(n, len(b), self.mtimes.get(n, 0.0)) for n, b in self.files.items()]


def layout(page_size: int) -> KVLayout:
    """A page of int64 token ids: 8 bytes per slot."""
    return KVLayout(model="sim", dtype="int64", page_size=page_size, num_layers=1, bytes_per_page=8 * page_size)


def tiered_cache(
    num_pages: int,
    page_size: int,
    host_slots: int = 0,
    disk_files: int = 0,
    *,
    clock: FakeClock | None = None,
    caching: bool = True,
    ttl: float = 10.0,
    store: MemoryStore | None = None,
) -> KVCache:
    lay = layout(page_size)
    tiers = KVTierConfig(
        layout=lay,
        host_kv_cache_bytes=host_slots * lay.bytes_per_page,
        kv_cache_dir_bytes=disk_files * lay.file_bytes,
        session_ttl=ttl,
    )
    disk_store = (store if store is not None else MemoryStore()) if disk_files else None
    return KVCache(num_pages, page_size, caching, tiers=tiers, clock=clock or FakeClock(), disk_store=disk_store)


def encode(tokens: list[int]) -> bytes:
    return array("q", tokens).tobytes()


def decode(payload: bytes) -> list[int]:
    return list(array("q", payload))


class TierSim:
    """Page contents of the device and host tiers, and the copies the executor has taken."""

    def __init__(self, kv: KVCache) -> None:
        size = kv.page_size
        self.kv = kv
        self.device: Slots = [[POISON] * size for _ in range(kv.num_pages)]
        host_slots = 0 if kv.host is None else kv.host.pool.num_pages
        self.host: Slots = [[POISON] * size for _ in range(host_slots)]
        self.running: dict[int, CopyOp] = {}  # taken, not confirmed

    def take(self) -> list[CopyOp]:
        """Take the kvcache's new copies; their destinations hold garbage until they land."""
        ops = self.kv.take_copies()
        for op in ops:
            if op.kind is CopyKind.HOST_TO_DEVICE:
                self.device[op.device_page] = [POISON] * self.kv.page_size
            elif op.kind in (CopyKind.DEVICE_TO_HOST, CopyKind.DISK_TO_HOST):
                self.host[op.host_slot] = [POISON] * self.kv.page_size
            self.running[op.op_id] = op
        return ops

    def finish(self, op_id: int) -> bool:
        """Run copy `op_id` now (reading its source as it is now) and confirm it; False if a disk read failed."""
        op = self.running.pop(op_id)
        ok = True
        if op.kind is CopyKind.DEVICE_TO_HOST:
            self.host[op.host_slot] = list(self.device[op.device_page])
        elif op.kind is CopyKind.HOST_TO_DEVICE:
            self.device[op.device_page] = list(self.host[op.host_slot])
        elif op.kind is CopyKind.HOST_TO_DISK:
            assert self.kv.disk is not None
            self.kv.disk.write_payload(op, encode(self.host[op.host_slot]))
        else:
            assert self.kv.disk is not None
            payload = self.kv.disk.read_payload(op)
            ok = payload is not None
            if payload is not None:
                self.host[op.host_slot] = decode(payload)
        self.kv.complete(op_id, ok)
        return ok

    def scrub_free_pages(self) -> None:
        """Fill free pages and slots with garbage: nothing may read a free page before writing it."""
        garbage = [POISON] * self.kv.page_size
        for page in self.kv.pool._free:
            self.device[page] = list(garbage)
        if self.kv.host is not None:
            for slot in self.kv.host.pool._free:
                self.host[slot] = list(garbage)

    def finish_all(self) -> None:
        self.take()
        while self.running:
            self.finish(min(self.running))
            self.take()

    def compute(self, pages: list[int], tokens: Sequence[int], start: int, end: int) -> None:
        """A forward pass writing positions start..end-1 then reading 0..end-1 back (as attention would)."""
        size = self.kv.page_size
        for position in range(start, end):
            self.device[pages[position // size]][position % size] = tokens[position]
        seen = [self.device[pages[p // size]][p % size] for p in range(end)]
        assert seen == list(tokens[:end]), f"KV read back {seen}, expected {list(tokens[:end])}"


def run_prompt(kv: KVCache, sim: TierSim, tokens: Sequence[int], match_pages: int) -> BlockTable:
    """A table with every token of `tokens` computed and its full pages published.

    Up to `match_pages` leading pages come from the prefix cache (host hits are
    loaded and landed first); the rest is computed.
    """
    table = kv.match_prefix(tokens, match_pages)
    sim.finish_all()
    start = len(table) * kv.page_size
    kv.allocate(table, kv.pages_for(len(tokens)) - len(table))
    sim.compute(table.pages, tokens, start, len(tokens))
    kv.publish(table, tokens, len(tokens))
    return table


def page_tokens_by_hash(prompts: Sequence[Sequence[int]], page_size: int) -> dict[bytes, list[int]]:
    """Chained hash -> the tokens of that page, for every full page of every prompt."""
    found: dict[bytes, list[int]] = {}
    for prompt in prompts:
        parent: bytes | None = None
        for i in range(len(prompt) // page_size):
            page = list(prompt[i * page_size : (i + 1) * page_size])
            parent = chain_hash(parent, page)
            found[parent] = page
    return found


def check_contents(sim: TierSim, known: dict[bytes, list[int]]) -> None:
    """Every landed page a tier indexes holds the tokens its hash stands for; no disk file reads wrong."""
    kv = sim.kv
    for page_hash, page in kv.index._page_of.items():
        if not kv.pool.is_pending(page):
            assert sim.device[page] == known[page_hash], f"device page {page} holds {sim.device[page]}"
    host = kv.host
    if host is not None:
        for page_hash, slot in host.index._page_of.items():
            if not host.pool.is_pending(slot):
                assert sim.host[slot] == known[page_hash], f"host slot {slot} holds {sim.host[slot]}"
    disk = kv.disk
    if disk is not None:
        for page_hash in disk.eviction_order():
            if disk.is_ready(page_hash):
                probe = CopyOp(0, CopyKind.DISK_TO_HOST, -1, 0, page_hash, page_file_name(page_hash))
                payload = disk.read_payload(probe)
                assert payload is None or decode(payload) == known[page_hash], "a disk file reads as wrong KV"
