"""`RequestPageTables`: the executor's copy of every running request's page list, kept across steps.

Plans are incremental (`scheduler/plan.py`): a row brings only the pages its
request gained since its previous row, and a plan names the tables to drop.
This object applies them. Each request owns one row ("slot") of a table kept
on the host and, on a GPU, mirrored on the device; the changed entries go to
the device with the step's one staging upload and are scattered there, and a
step's `[rows, pages]` page table is gathered from the slots on the device
(`staging.step_inputs`).
So the host work per step is proportional to the rows and the pages that
changed, never to the context length: a 128K-token row costs the host what a
1K-token row does (`benchmarks/scheduler_overhead.py`).

Entries past a slot's length are 0, as in a page table built from scratch, and
one extra slot holds the scratch page that padded CUDA-graph rows read.

Speculative decoding rolls back: after a verify row, the pages that held only
rejected drafts go back to the scheduler, and the request's next row says so
with a `first_new_page` below the held length. The slot is cut there (the
dropped entries zeroed, on the device too) before the row's new pages are
added; the scheduler may already have handed the dropped pages to another
request of the same plan.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenspeed.scheduler.plan import ExecutionPlan


class RequestPageTables:
    def __init__(self, device: torch.device, *, scratch_page: int, rows: int = 16, width: int = 64) -> None:
        self.device = device
        self.host = np.zeros((rows, width), dtype=np.int64)
        self.lengths = np.zeros(rows, dtype=np.int64)  # pages held in each slot
        self._slot_of: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))
        self.scratch_slot = self._take_slot("")
        self.host[self.scratch_slot, 0] = scratch_page
        self.lengths[self.scratch_slot] = 1
        self._device_table: torch.Tensor | None = None  # None: rebuild from the host on the next upload
        self._changed: list[np.ndarray] = []  # flat host indices written since the last upload

    @property
    def num_requests(self) -> int:
        return len(self._slot_of)

    def apply(self, plan: ExecutionPlan) -> np.ndarray:
        """Drop the plan's released tables, cut rolled-back ones, add its rows' new pages; the slot of each
        row (int64)."""
        for request_id in plan.released_request_ids:
            slot = self._slot_of.pop(request_id, None)
            if slot is None:
                raise RuntimeError(f"plan {plan.step_id} releases {request_id!r}, whose page table is not held")
            self._clear(slot)
            self._free.append(slot)
        slots = np.empty(len(plan.rows), dtype=np.int64)
        for i, row in enumerate(plan.rows):
            slot = self._slot_of.get(row.request_id)
            if row.first_new_page == 0:
                if slot is None:
                    slot = self._take_slot(row.request_id)
                else:
                    raise RuntimeError(f"{row.request_id!r} starts a fresh page table without releasing its old one")
            elif slot is None or self.lengths[slot] < row.first_new_page:
                held = None if slot is None else int(self.lengths[slot])
                raise RuntimeError(
                    f"{row.request_id!r} adds pages at {row.first_new_page}, but {held} are held for it"
                )
            elif self.lengths[slot] > row.first_new_page:  # rejected drafts' pages were rolled back
                self._cut(slot, row.first_new_page)
            if row.new_page_ids:
                end = row.num_pages
                self._fit(end)
                self.host[slot, row.first_new_page : end] = row.new_page_ids
                self._changed.append(slot * self.host.shape[1] + np.arange(row.first_new_page, end))
                self.lengths[slot] = end
            slots[i] = slot
        return slots

    def width(self, slots: np.ndarray) -> int:
        """Columns a batch of these slots needs (its longest table, at least 1)."""
        return max(int(self.lengths[slots].max()) if slots.size else 1, 1)

    def pending_upload(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(flat indices, page ids) the device copy lacks, to go with the step's upload; None if none."""
        if self.device.type != "cuda" or self._device_table is None or not self._changed:
            return None
        index = np.concatenate(self._changed)
        self._changed.clear()
        return index, self.host.reshape(-1)[index]

    def device_table(self, updates: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Every slot's page ids on the device (`[slots, width]`; int32 on a GPU), after applying `updates`;
        a step gathers its rows from it (`kernels/staging`)."""
        if self.device.type != "cuda":
            self._changed.clear()
            return torch.from_numpy(self.host)
        if self._device_table is None:
            self._device_table = torch.from_numpy(self.host).to(self.device, torch.int32)
            self._changed.clear()
        elif updates is not None:
            index, values = updates
            self._device_table.view(-1).index_copy_(0, index, values.to(torch.int32))
        return self._device_table

    # ---- slots -------------------------------------------------------------------

    def _take_slot(self, request_id: str) -> int:
        if not self._free:
            self._grow(rows=2 * self.host.shape[0])
        slot = self._free.pop()
        if request_id:
            self._slot_of[request_id] = slot
        return slot

    def _clear(self, slot: int) -> None:
        self._cut(slot, 0)

    def _cut(self, slot: int, keep: int) -> None:
        """Keep the slot's first `keep` pages; the dropped entries go back to 0 (on the device too)."""
        length = int(self.lengths[slot])
        if length > keep:
            self.host[slot, keep:length] = 0
            self._changed.append(slot * self.host.shape[1] + np.arange(keep, length))
            self.lengths[slot] = keep

    def _fit(self, num_pages: int) -> None:
        width = self.host.shape[1]
        if num_pages > width:
            while width < num_pages:
                width *= 2
            self._grow(width=width)

    def _grow(self, *, rows: int | None = None, width: int | None = None) -> None:
        """A bigger host table (the device copy is rebuilt from it at the next gather)."""
        old_rows, old_width = self.host.shape
        rows, width = rows or old_rows, width or old_width
        host = np.zeros((rows, width), dtype=np.int64)
        host[:old_rows, :old_width] = self.host
        self.host = host
        self.lengths = np.concatenate([self.lengths, np.zeros(rows - old_rows, dtype=np.int64)])
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
        self._device_table = None
        self._changed.clear()
