"""`DiskTier` (L3): page files keyed by chained hash, bounded by bytes, evicted LRU.

The host tier is bounded by RAM; a coding agent's sessions outlive it (a
developer comes back after lunch). The disk tier keeps host slots that would
be evicted as one file per page, named by the page's chained hash, under a
directory per KV layout (`<kv_cache_dir>/<layout fingerprint>/`), so two
models or dtypes never read each other's files even when they share a
directory. It survives restarts: on start the directory is scanned and every
well-named file of the right size is adopted (oldest first in the LRU);
leftover temporary files and wrong-sized files are deleted. Whether a file
really holds the right page is only known when it is read: `read_payload`
verifies the header and checksum (page_file.py) and a bad file is a miss.

Split of work: the scheduler thread owns this index (names, the byte budget,
LRU eviction, which files copies in flight use); the executor's IO thread
calls only `write_payload` / `read_payload`, which touch nothing but the
file a copy op names. An entry being written is `pending` (not readable, not
evictable) and an entry being read is pinned (not evictable), so the index
never deletes a file the IO thread is using.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokenspeed.kvcache.copy_ops import CopyOp
from tokenspeed.kvcache.errors import KVCacheError
from tokenspeed.kvcache.page_file import (
    FILE_SUFFIX,
    DirectoryStore,
    KVLayout,
    PageFileStore,
    decode_page,
    encode_header,
    page_file_name,
)

_HASH_HEX = 32
_HEX_DIGITS = frozenset("0123456789abcdef")  # page_file_name writes lower case


@dataclass(slots=True)
class _Entry:
    pins: int = 0  # copies reading or writing the file
    pending: bool = False  # still being written: not readable


class DiskTier:
    __slots__ = ("layout", "store", "budget_bytes", "capacity", "_entries")

    def __init__(self, store: PageFileStore, layout: KVLayout, budget_bytes: int) -> None:
        if budget_bytes < layout.file_bytes:
            raise ValueError(
                f"kv_cache_dir_bytes={budget_bytes} cannot hold one page file of {layout.file_bytes} bytes."
            )
        self.layout = layout
        self.store = store
        self.budget_bytes = budget_bytes
        self.capacity = budget_bytes // layout.file_bytes  # every file has the same size
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # first = evicted first
        self._adopt_existing()

    @classmethod
    def open(cls, directory: str, layout: KVLayout, budget_bytes: int) -> DiskTier:
        """A disk tier in `directory/<layout fingerprint>/`, adopting the files a previous run left there."""
        return cls(DirectoryStore(os.path.join(directory, layout.fingerprint().hex())), layout, budget_bytes)

    def _adopt_existing(self) -> None:
        adopted: list[tuple[float, bytes]] = []
        for found in self.store.list():
            stem = found.name.removesuffix(FILE_SUFFIX)
            well_named = (
                found.name.endswith(FILE_SUFFIX) and len(stem) == _HASH_HEX and set(stem) <= _HEX_DIGITS
            )
            if well_named and found.size == self.layout.file_bytes:
                adopted.append((found.mtime, bytes.fromhex(stem)))
            else:  # a temporary file of a killed run, or a file that cannot be a page of this layout
                self.store.delete(found.name)
        for _, page_hash in sorted(adopted):
            self._entries[page_hash] = _Entry()
        while len(self._entries) > self.capacity:
            self._drop(next(iter(self._entries)))

    # ---- the index (scheduler thread) -------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.layout.file_bytes

    @property
    def num_pending(self) -> int:
        return sum(1 for e in self._entries.values() if e.pending)

    def contains(self, page_hash: bytes) -> bool:
        return page_hash in self._entries

    def is_ready(self, page_hash: bytes) -> bool:
        entry = self._entries.get(page_hash)
        return entry is not None and not entry.pending

    def pins(self, page_hash: bytes) -> int:
        """Copies in flight reading or writing the file."""
        return self._entries[page_hash].pins

    def eviction_order(self) -> list[bytes]:
        return list(self._entries)

    def reserve(self, page_hash: bytes, may_evict: Callable[[bytes], bool] | None = None) -> str | None:
        """Make room for a new file of `page_hash` (pending, pinned by its write); its name, or None if full.

        Evicts the least recently used files that no copy uses and `may_evict` accepts
        (write-back spares files of pages the host holds: see `tier_transfers.writeback`).
        """
        if page_hash in self._entries:
            raise KVCacheError("page is already on disk; reserve only pages the disk tier lacks")
        while len(self._entries) >= self.capacity:
            victim = next(
                (h for h, e in self._entries.items() if not e.pins and (may_evict is None or may_evict(h))), None
            )
            if victim is None:
                return None
            self._drop(victim)
        self._entries[page_hash] = _Entry(pins=1, pending=True)
        return page_file_name(page_hash)

    def land(self, page_hash: bytes) -> None:
        """The write of `page_hash` was confirmed: the file may be read."""
        entry = self._entries[page_hash]
        if not entry.pending:
            raise KVCacheError("no write of this page is in flight")
        entry.pending = False
        entry.pins -= 1

    def pin(self, page_hash: bytes) -> str:
        """A read of the file starts (it is not evicted meanwhile); counts as a use for the LRU."""
        entry = self._entries[page_hash]
        if entry.pending:
            raise KVCacheError("the file is still being written")
        entry.pins += 1
        self._entries.move_to_end(page_hash)
        return page_file_name(page_hash)

    def unpin(self, page_hash: bytes) -> None:
        entry = self._entries[page_hash]
        if entry.pins <= 0 or entry.pending:
            raise KVCacheError("no read of this file is in flight")
        entry.pins -= 1

    def discard(self, page_hash: bytes) -> None:
        """Forget a file that failed to write or to verify, and delete it."""
        entry = self._entries[page_hash]
        if entry.pins > (1 if entry.pending else 0):
            raise KVCacheError("a file other copies still use cannot be discarded")
        self._drop(page_hash)

    def _drop(self, page_hash: bytes) -> None:
        del self._entries[page_hash]
        self.store.delete(page_file_name(page_hash))

    # ---- the bytes (executor's IO thread) ---------------------------------------------

    def write_payload(self, op: CopyOp, payload: bytes | memoryview) -> None:
        """Write the page of a HOST_TO_DISK copy (header + checksum + `payload`); raises OSError."""
        assert op.file_name is not None and op.page_hash is not None, "not a disk copy"
        if len(payload) != self.layout.bytes_per_page:
            raise ValueError(f"a page holds {self.layout.bytes_per_page} bytes, got {len(payload)}")
        self.store.write(op.file_name, [encode_header(self.layout, op.page_hash, payload), payload])

    def read_payload(self, op: CopyOp) -> bytes | None:
        """The verified page of a DISK_TO_HOST copy, or None (missing, truncated, corrupt or foreign)."""
        assert op.file_name is not None and op.page_hash is not None, "not a disk copy"
        blob = self.store.read(op.file_name)
        return None if blob is None else decode_page(self.layout, op.page_hash, blob)

    # ---- checking ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.capacity, "the disk tier is over its byte budget"
        assert self.used_bytes <= self.budget_bytes, "the disk tier is over its byte budget"
        for entry in self._entries.values():
            assert entry.pins >= (1 if entry.pending else 0), "a file being written is not pinned by its write"
