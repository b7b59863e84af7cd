"""`HostKVTier`: the bytes of the host and disk KV tiers, and the copies that move them.

The scheduler's `kvcache/` decides which device page goes to which host slot
or file (`CopyOp`s on each plan); this runs them. A host slot holds one
device page of every layer (K then V per layer, as raw bytes) in one row of
a host tensor, pinned on a GPU so the copies are true DMA. The rows live in
chunks of about 1 GiB: allocated up front when the size was asked for
(`--host-kv-cache-bytes`), on first use for the default (a quarter of the
host's memory on a GPU, which an engine that never spills, such as a test,
must not pay for pinning). A plan's copies run
before its rows, in two batches:

* host -> device (restore, host hits): the rows are copied into a staging
  buffer, then scattered into every layer's pages;
* device -> host (retraction of private pages, write-back of cached pages):
  the pages are gathered on the device into one staging buffer, then each
  run of consecutive slots is one async copy into the pinned rows.

The two never touch the same page or slot (kvcache/copy_ops.py), so their
order is free: loads go first. On a GPU both run on a side stream that
first waits for the compute stream (the sources hold what earlier steps
wrote); the compute stream waits only for the loads (this plan's rows read
those pages), so the write-back overlaps the step's compute. A copy is
confirmed (`ExecutionResult.completed_copies`) once its stream event has
passed: the copies of a plan are confirmed when that plan is collected, so
a retraction is restorable one step later. Until then `kvcache/` keeps both
ends pinned, which is what makes the asynchronous copies safe.

Disk copies (HOST_TO_DISK, DISK_TO_HOST) run on one IO thread, in the page
file format of `kvcache/page_file.py`: a file that is missing, truncated,
corrupt or written for another layout is confirmed with ok=False, a miss.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.kvcache import CopyKind, CopyOp, KVLayout
from tokenspeed.kvcache.page_file import DirectoryStore, decode_page, encode_header

logger = logging.getLogger("tokenspeed.executor")

_HOST_MEMORY_FRACTION = 0.25  # of the host's available memory, the default host tier on a GPU
_CHUNK_BYTES = 1 << 30  # host rows are allocated (and pinned) this much at a time, on first use


def default_host_kv_cache_bytes(device: torch.device) -> int:
    """A quarter of the host's available memory on a GPU; 0 on the CPU (the KV already lives in host memory)."""
    if device.type != "cuda":
        return 0
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0
    return int(available * _HOST_MEMORY_FRACTION)


@dataclass(slots=True)
class _Batch:
    step_id: int
    op_ids: list[int]
    done: torch.cuda.Event | None  # None: ran synchronously (CPU)


class HostKVTier:
    def __init__(
        self,
        storage: PagedKVStorage,
        layout: KVLayout,
        num_slots: int,
        device: torch.device,
        kv_cache_dir: str | None = None,
        chunk_bytes: int = _CHUNK_BYTES,
        eager: bool = False,
    ) -> None:
        """`eager`: allocate (pin) every row now, as a server given an explicit host size wants: no
        allocation stalls while it serves. Otherwise rows are allocated chunk by chunk on first use."""
        self.storage = storage
        self.layout = layout
        self.device = device
        self.num_slots = num_slots
        # Every tensor indexed by page id holds part of a page: K and V per layer, and whatever else a
        # storage keeps per page (e.g. FP8 scales) if it lists its tensors in `page_tensors()`.
        listed = getattr(storage, "page_tensors", None)
        tensors = list(listed()) if callable(listed) else [*storage.k, *storage.v]
        self._tensors = [t.view(torch.uint8).view(t.shape[0], -1) for t in tensors]
        self._widths = [t.shape[1] for t in self._tensors]
        if sum(self._widths) != layout.bytes_per_page:
            raise ValueError(f"KV layout says {layout.bytes_per_page} bytes per page, the storage's tensors "
                             f"{sum(self._widths)}: a per-page tensor is not copied (see page_tensors)")
        self._pin = device.type == "cuda"
        self._chunk_slots = max(1, chunk_bytes // layout.bytes_per_page)
        self._chunks: list[torch.Tensor | None] = [None] * -(-num_slots // self._chunk_slots)
        self._stream = torch.cuda.Stream(device) if self._pin else None
        if eager:
            for index in range(len(self._chunks)):
                self.rows(index * self._chunk_slots)
        self._batches: deque[_Batch] = deque()
        self._disk_store = None
        if kv_cache_dir is not None:
            self._disk_store = DirectoryStore(os.path.join(kv_cache_dir, layout.fingerprint().hex()))
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenspeed-kv-disk")
        self._disk_jobs: dict[int, Future[bool]] = {}
        self.bytes_copied = 0

    # ---- running a plan's copies -----------------------------------------------------------

    def run(self, step_id: int, copies: Sequence[CopyOp]) -> None:
        """Start `copies` (device <-> host now, disk on the IO thread); rows launched after this read
        the host -> device pages safely."""
        to_host = [op for op in copies if op.kind is CopyKind.DEVICE_TO_HOST]
        to_device = [op for op in copies if op.kind is CopyKind.HOST_TO_DEVICE]
        for op in copies:
            if op.kind is CopyKind.HOST_TO_DISK or op.kind is CopyKind.DISK_TO_HOST:
                self.rows(op.host_slot)  # the chunk exists before the IO thread touches it (no racing allocation)
                self._disk_jobs[op.op_id] = self._io.submit(self._disk_copy, op)
        if not to_host and not to_device:
            return
        stream = self._stream
        if stream is None:
            self._to_host(to_host)
            self._to_device(to_device)
            self._batches.append(_Batch(step_id, [op.op_id for op in to_host + to_device], None))
            return
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            self._to_device(to_device)  # loads first: this plan's rows wait for them, not for the write-back
            if to_device:
                loaded = torch.cuda.Event()
                loaded.record(stream)
                compute.wait_event(loaded)
            self._to_host(to_host)
            done = torch.cuda.Event()
            done.record(stream)
        self._batches.append(_Batch(step_id, [op.op_id for op in to_host + to_device], done))

    def finished(self, step_id: int, wait_all: bool = False) -> list[tuple[int, bool]]:
        """(op id, ok) of the copies done: every device copy of plans up to `step_id` (waited for), any
        later one already done, and the disk copies done (all of them, waited for, if `wait_all`)."""
        out: list[tuple[int, bool]] = []
        while self._batches:
            batch = self._batches[0]
            if batch.done is not None:
                if batch.step_id <= step_id or wait_all:
                    batch.done.synchronize()
                elif not batch.done.query():
                    break
            self._batches.popleft()
            out.extend((op_id, True) for op_id in batch.op_ids)
        if wait_all and self._disk_jobs:
            wait(list(self._disk_jobs.values()))
        for op_id, job in list(self._disk_jobs.items()):
            if job.done():
                del self._disk_jobs[op_id]
                out.append((op_id, job.result()))
        return out

    def close(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=False)

    def rows(self, slot: int, count: int = 1) -> torch.Tensor:
        """Host slots `slot .. slot + count - 1` (one chunk) as a `[count, bytes_per_page]` view."""
        index, offset = divmod(slot, self._chunk_slots)
        if offset + count > self._chunk_slots or slot + count > self.num_slots:
            raise IndexError(f"host slots {slot}..{slot + count - 1} are not in one chunk")
        chunk = self._chunks[index]
        if chunk is None:
            size = min(self._chunk_slots, self.num_slots - index * self._chunk_slots)
            chunk = torch.empty((size, self.layout.bytes_per_page), dtype=torch.uint8, pin_memory=self._pin)
            self._chunks[index] = chunk
        return chunk[offset : offset + count]

    @property
    def allocated_bytes(self) -> int:
        return sum(c.numel() for c in self._chunks if c is not None)

    # ---- device <-> host ------------------------------------------------------------------------

    def _to_host(self, ops: list[CopyOp]) -> None:
        if not ops:
            return
        pages = torch.tensor([op.device_page for op in ops], dtype=torch.long, device=self.device)
        staging = torch.cat([t.index_select(0, pages) for t in self._tensors], dim=1)
        slots = [op.host_slot for op in ops]
        for start, end in _runs(slots, self._chunk_slots):
            self.rows(slots[start], end - start).copy_(staging[start:end], non_blocking=self._pin)
        self.bytes_copied += staging.numel()

    def _to_device(self, ops: list[CopyOp]) -> None:
        if not ops:
            return
        slots = [op.host_slot for op in ops]
        staging = torch.empty((len(ops), self.layout.bytes_per_page), dtype=torch.uint8, device=self.device)
        for start, end in _runs(slots, self._chunk_slots):
            staging[start:end].copy_(self.rows(slots[start], end - start), non_blocking=self._pin)
        pages = torch.tensor([op.device_page for op in ops], dtype=torch.long, device=self.device)
        offset = 0
        for tensor, width in zip(self._tensors, self._widths, strict=True):
            tensor.index_copy_(0, pages, staging[:, offset : offset + width])
            offset += width
        self.bytes_copied += staging.numel()

    # ---- host <-> disk (IO thread) ------------------------------------------------------------

    def _disk_copy(self, op: CopyOp) -> bool:
        """One disk copy; False if the file could not be written or read back intact (a miss)."""
        store = self._disk_store
        assert store is not None and op.file_name is not None and op.page_hash is not None, "a disk copy without a disk"
        row = self.rows(op.host_slot)[0]
        try:
            if op.kind is CopyKind.HOST_TO_DISK:
                payload = row.numpy().tobytes()
                store.write(op.file_name, [encode_header(self.layout, op.page_hash, payload), payload])
                return True
            blob = store.read(op.file_name)
            payload_read = None if blob is None else decode_page(self.layout, op.page_hash, blob)
            if payload_read is None:
                return False
            row.copy_(torch.frombuffer(bytearray(payload_read), dtype=torch.uint8))
            return True
        except OSError as exc:
            logger.warning("KV disk tier: %s of %s failed: %s", op.kind.value, op.file_name, exc)
            return False


def _runs(slots: list[int], chunk_slots: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of `slots` whose values are consecutive within one chunk (one copy each)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or slots[i] % chunk_slots == 0:
            runs.append((start, i))
            start = i
    return runs
