"""Building a step's `ForwardBatch` (`batch/forward_batch.py`) from the rows of a plan.

Input preparation is index arithmetic on the host (numpy, no per-token Python
loop) written into one pinned staging buffer and sent with a single
non-blocking host-to-device copy; one kernel (`staging.step_inputs`) turns it
into what the forward reads. Nothing here waits for the device.

Overlap scheduling: a token id `PLACEHOLDER_TOKEN_ID` in a row's input means
"the token this stream sampled in the previous step", which is still on the
device when this step is prepared. `placeholder_sources` records, per token,
which element of the previous step's sampled-ids tensor to read; that kernel
resolves it on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenspeed.batch.forward_batch import AttentionMetadata, ForwardBatch, HostBatch
from tokenspeed.kernels.registry import platform_of, select_kernel
from tokenspeed.kernels.staging.step_inputs import StagedInputs, StepInputs
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID

if TYPE_CHECKING:
    from tokenspeed.executor.page_tables import RequestPageTables


@dataclass(slots=True)
class RowSpec:
    """The minimum a batch row needs: new tokens, where they start, and the row's pages.

    `page_ids` is left empty when the pages come from the runner's `RequestPageTables`.
    `padding`: the row's first tokens are filler (a verify row padded to the q_len of a CUDA
    graph): they write their K/V to the scratch page and their outputs are never read; the
    row's real tokens keep their positions at the end of the row, so attention is unchanged.
    """

    input_token_ids: Sequence[int]
    start_position: int
    page_ids: Sequence[int] = ()
    padding: int = 0


def build_host_batch(
    rows: Sequence[RowSpec],
    page_size: int,
    logits_indices: Sequence[int],
    placeholder_source: dict[str, int] | None = None,
    row_ids: Sequence[str] | None = None,
    pad_rows_to: int = 0,
    scratch_page: int = 0,
    tables: RequestPageTables | None = None,
    table_slots: np.ndarray | None = None,
    pad_row_tokens: int = 1,
) -> HostBatch:
    """Flatten rows into index arrays. Pure index arithmetic, vectorised with numpy.

    `pad_rows_to` appends rows of `pad_row_tokens` tokens (positions 0.., page
    table and slots on `scratch_page`) so a CUDA graph of that batch size can run;
    a row's own `padding` tokens are filler written to `scratch_page` (see `RowSpec`).
    Placeholder tokens are looked up in `placeholder_source` by `row_ids[i]`.
    With `tables` the pages are not in the rows: row i's are slot `table_slots[i]`
    of `tables` (already updated for this plan), and no page table is built here.
    """
    num_rows = len(rows)
    lens = np.fromiter((len(r.input_token_ids) for r in rows), dtype=np.int64, count=num_rows)
    starts = np.fromiter((r.start_position for r in rows), dtype=np.int64, count=num_rows)
    if tables is not None:
        assert table_slots is not None and table_slots.size == num_rows
        num_pages = tables.lengths[table_slots]
    else:
        num_pages = np.fromiter((len(r.page_ids) for r in rows), dtype=np.int64, count=num_rows)
    ends = starts + lens
    short = np.nonzero(-(-ends // page_size) > num_pages)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(f"row {i} covers {int(ends[i])} positions but has only {int(num_pages[i])} pages")

    if bool((lens == 1).all()):
        input_ids = np.fromiter((r.input_token_ids[0] for r in rows), dtype=np.int64, count=num_rows)
    else:
        input_ids = np.fromiter(
            (t for r in rows for t in r.input_token_ids), dtype=np.int64, count=int(lens.sum())
        )
    query_start = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    token_row = np.repeat(np.arange(num_rows, dtype=np.int64), lens)
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - query_start[:-1], lens)

    total_rows = max(num_rows, pad_rows_to)
    max_pages = max(int(num_pages.max()) if num_rows else 1, 1)
    page_table: np.ndarray | None = None
    if tables is None:
        page_table = np.zeros((total_rows, max_pages), dtype=np.int64)
        for i, row in enumerate(rows):
            page_table[i, : len(row.page_ids)] = row.page_ids
    padding = np.fromiter((r.padding for r in rows), dtype=np.int64, count=num_rows)
    filler = None
    if padding.any():  # filler tokens: real pages at clamped positions for the lookup, then the scratch slot
        filler = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start[:-1], lens) < np.repeat(padding, lens)
        positions = np.maximum(positions, 0)
    if tables is not None:
        assert table_slots is not None
        pages = tables.host[table_slots[token_row], positions // page_size]
    else:
        pages = page_table[token_row, positions // page_size]  # type: ignore[index]
    slots = pages * page_size + positions % page_size
    if filler is not None:
        slots = np.where(filler, scratch_page * page_size, slots)

    sources: np.ndarray | None = None
    holes = np.nonzero(input_ids == PLACEHOLDER_TOKEN_ID)[0]
    if holes.size:
        if placeholder_source is None or row_ids is None:
            raise RuntimeError("a row reads its input from the previous step, but none is in flight")
        sources = np.full(num_tokens, -1, dtype=np.int64)
        for t in holes.tolist():
            stream = row_ids[int(token_row[t])]
            if stream not in placeholder_source:
                raise RuntimeError(f"stream {stream!r} reads a token the previous step did not sample")
            sources[t] = placeholder_source[stream]

    seq_lens = ends
    padded_slots = table_slots
    if total_rows > num_rows:  # graph padding: rows of scratch tokens
        pad = total_rows - num_rows
        extra = pad * pad_row_tokens
        if page_table is not None:
            page_table[num_rows:, 0] = scratch_page
        elif tables is not None and table_slots is not None:
            padded_slots = np.concatenate([table_slots, np.full(pad, tables.scratch_slot, dtype=np.int64)])
        input_ids = np.concatenate([input_ids, np.zeros(extra, dtype=np.int64)])
        positions = np.concatenate([positions, np.tile(np.arange(pad_row_tokens, dtype=np.int64), pad)])
        slots = np.concatenate([slots, np.full(extra, scratch_page * page_size, dtype=np.int64)])
        seq_lens = np.concatenate([seq_lens, np.full(pad, pad_row_tokens, dtype=np.int64)])
        query_start = np.concatenate(
            [query_start, num_tokens + pad_row_tokens * np.arange(1, pad + 1, dtype=np.int64)]
        )
        if sources is not None:
            sources = np.concatenate([sources, np.full(extra, -1, dtype=np.int64)])
    return HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
        seq_lens=seq_lens,
        query_start=query_start,
        page_table=page_table,
        placeholder_sources=sources,
        max_query_len=int(lens.max()) if num_rows else 0,
        table_slots=padded_slots,
        table_width=max_pages,
        table_updates=None if tables is None else tables.pending_upload(),
    )


class StagingRing:
    """Pinned host buffers for the one H2D copy per step, reused round-robin once their copy is done."""

    def __init__(self, device: torch.device, slots: int = 3) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.resolve = select_kernel("staging", "step_inputs", platform=platform_of(device)).impl
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Concatenate int64 arrays, copy them to the device in one transfer; views of each, in order."""
        sizes = [int(a.size) for a in arrays]
        total = max(sum(sizes), 1)
        if not self.pinned:
            flat = torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(1, dtype=np.int64))
            return list(flat.split(sizes)) if arrays else []
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        event = self._events[i]
        if event is not None:
            event.synchronize()  # normally long done: the copy ran two steps ago
        buf = self._buffers[i]
        if buf is None or buf.numel() < total:
            buf = torch.empty(max(total, 4096) * 2, dtype=torch.int64, pin_memory=True)
            self._buffers[i] = buf
        host = buf.numpy()
        offset = 0
        for a, n in zip(arrays, sizes):
            host[offset : offset + n] = a.reshape(-1)
            offset += n
        dev = buf[:total].to(self.device, non_blocking=True)
        if event is None:
            event = self._events[i] = torch.cuda.Event()
        event.record()
        return list(dev[: sum(sizes)].split(sizes))


def to_forward_batch(
    host: HostBatch,
    staging: StagingRing,
    page_size: int,
    previous_samples: torch.Tensor | None = None,
    tables: RequestPageTables | None = None,
    out: StepInputs | None = None,
) -> ForwardBatch:
    """Send a HostBatch to the device and resolve it there (`staging.step_inputs`): placeholder tokens
    from `previous_samples`, the page table from `tables` for a batch built on them, int32 lengths.

    `out`: where the device inputs go (a CUDA graph's static buffers); new tensors when None.
    """
    views = staging.upload(host.arrays())
    input_ids, positions, slots, logits_indices, seq_lens, query_start, table = views[:7]
    rest = views[7:]
    sources = None
    if host.placeholder_sources is not None:  # resolved from `previous_samples` (the kernel checks it is given)
        sources, rest = rest[0], rest[1:]
    rows = int(host.seq_lens.size)
    if host.page_table is not None:
        table, table_rows = table.view(rows, -1), None
    else:
        if tables is None:
            raise RuntimeError("this batch's pages are in a RequestPageTables, but none was given")
        updates = (rest[0], rest[1]) if host.table_updates is not None else None
        table, table_rows = tables.device_table(updates), table
    staged = StagedInputs(
        input_ids, positions, slots, seq_lens, query_start, table, table_rows, host.table_width, sources,
        previous_samples,
    )  # fmt: skip
    inputs = staging.resolve(staged, out)
    attn = AttentionMetadata(
        page_size=page_size,
        query_start=host.query_start.tolist(),
        seq_lens=host.seq_lens.tolist(),
        page_table=inputs.page_table,
        slot_mapping=inputs.slot_mapping,
        max_query_len=host.max_query_len,
        max_seq_len=int(host.seq_lens.max()) if rows else 0,
        seq_lens_tensor=inputs.seq_lens,
        query_start_tensor=inputs.query_start,
    )
    return ForwardBatch(
        input_ids=inputs.input_ids, positions=inputs.positions, attn=attn, logits_indices=logits_indices
    )


def build_forward_batch(
    rows: Sequence[RowSpec],
    page_size: int,
    logits_indices: Sequence[int],
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Flatten rows into a ForwardBatch on `device` (tests and one-off callers; the runner stages)."""
    host = build_host_batch(rows, page_size, logits_indices)
    return to_forward_batch(host, StagingRing(torch.device(device)), page_size)
