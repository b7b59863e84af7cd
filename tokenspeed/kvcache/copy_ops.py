"""Copies between KV tiers: the records the executor runs, and the ledger of those in flight.

The kvcache decides WHAT moves (which device page to which host slot, which
slot to which file); the executor moves the bytes, asynchronously (a side
CUDA stream and pinned host memory on a GPU, a plain copy on the CPU; disk
files on an IO thread), and confirms each copy by id. Until then both ends
are pinned in their pools (see page_pool.py): the source is never reused
while the copy reads it, and the destination is "pending", never read before
the copy lands. So the executor may finish copies in any order and confirm
them whenever it likes; the scheduler never has to wait for one to plan.

Copies that are emitted together never conflict with each other or with any
copy still in flight: a pending page is never a source, a pinned page is never
a destination. The executor may batch each kind into one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tokenspeed.kvcache.errors import KVCacheError


class CopyKind(Enum):
    DEVICE_TO_HOST = "device_to_host"  # write-back of a cached page, or a retracted request's private page
    HOST_TO_DEVICE = "host_to_device"  # a host hit, or a restored page
    HOST_TO_DISK = "host_to_disk"  # write-back of a cached host slot
    DISK_TO_HOST = "disk_to_host"  # a prefetched disk hit (the executor verifies the file; it may fail)


@dataclass(slots=True, frozen=True)
class CopyOp:
    """One page to move. Unused ends are -1 (device_page of disk copies) or None (file_name)."""

    op_id: int
    kind: CopyKind
    device_page: int
    host_slot: int
    page_hash: bytes | None  # the chained hash (None: a retracted request's unpublished page)
    file_name: str | None = None  # disk copies: the file in the disk tier's store


class UnknownCopy(KVCacheError, KeyError):
    """A copy was confirmed that is not in flight (never emitted, or confirmed twice)."""


class CopyLedger:
    """Copies emitted but not yet taken by the executor (`outbox`) and those not yet confirmed."""

    __slots__ = ("_next_id", "_in_flight", "_outbox")

    def __init__(self) -> None:
        self._next_id = 0
        self._in_flight: dict[int, CopyOp] = {}
        self._outbox: list[CopyOp] = []

    def __len__(self) -> int:
        return len(self._in_flight)

    def emit(
        self,
        kind: CopyKind,
        *,
        device_page: int = -1,
        host_slot: int,
        page_hash: bytes | None,
        file_name: str | None = None,
    ) -> CopyOp:
        self._next_id += 1
        op = CopyOp(self._next_id, kind, device_page, host_slot, page_hash, file_name)
        self._in_flight[op.op_id] = op
        self._outbox.append(op)
        return op

    def take(self) -> list[CopyOp]:
        """The copies emitted since the last call, in emission order (they still count as in flight)."""
        taken, self._outbox = self._outbox, []
        return taken

    def peek(self, op_id: int) -> CopyOp:
        op = self._in_flight.get(op_id)
        if op is None:
            raise UnknownCopy(f"copy {op_id} is not in flight (never emitted, or already confirmed)")
        return op

    def pop(self, op_id: int) -> CopyOp:
        op = self.peek(op_id)
        del self._in_flight[op_id]
        return op

    def in_flight(self) -> list[CopyOp]:
        return list(self._in_flight.values())
