"""`staging.step_inputs`: a step's uploaded index arrays -> the tensors its forward reads.

Every step sends its index arrays to the device in one int64 copy
(`executor/batch_builder.StagingRing`). What the forward reads differs from
what was sent in three ways: placeholder tokens (overlap scheduling) are the
previous step's samples, still on the device; the page table is gathered from
the request tables' device copy; and the attention kernels take int32 lengths
and tables. Done with torch ops that is eight small launches, and a CUDA-graph
step copies five tensors more into the graph's static buffers: at one row
about 15 us of kernels before every step's graph, each a launch of its own
(`benchmarks/results/h100/wave2/argmax_2026-12-07/tri_1.fp8.profile.txt`).
The Triton kernel (`step_inputs_triton.py`) does all of it in one launch and
writes straight into `out`, the graph's buffers when a graph runs the step.
This module holds the op's arguments and its REFERENCE, the torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from tokenspeed.kernels.registry import Band, register_kernel


@dataclass(slots=True)
class StagedInputs:
    """A step's arrays as uploaded (int64 views of the staging copy), and what resolves them."""

    input_ids: torch.Tensor  # [tokens]; placeholders where `sources` >= 0
    positions: torch.Tensor  # [tokens]
    slot_mapping: torch.Tensor  # [tokens]
    seq_lens: torch.Tensor  # [rows]
    query_start: torch.Tensor  # [rows + 1]
    table: torch.Tensor  # [table rows, >= width] page ids, any integer dtype
    table_rows: torch.Tensor | None  # [rows]: the row of `table` each batch row reads (None: row i reads row i)
    width: int  # page-table columns the step needs
    sources: torch.Tensor | None = None  # [tokens]: index into `previous`, -1 where the token is real
    previous: torch.Tensor | None = None  # the previous step's sampled ids

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(slots=True)
class StepInputs:
    """The forward's inputs: ids, positions and slots int64 `[tokens]`, lengths int32 `[rows]`, query starts
    int32 `[rows + 1]`, the page table int32 `[rows, width]` (a view of a wider buffer where a graph runs)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    page_table: torch.Tensor

    @staticmethod
    def empty(num_tokens: int, num_rows: int, width: int, device: torch.device) -> StepInputs:
        def ints(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device=device)

        return StepInputs(
            ints(num_tokens), ints(num_tokens), ints(num_tokens),
            ints(num_rows, dtype=torch.int32), ints(num_rows + 1, dtype=torch.int32),
            ints(num_rows, width, dtype=torch.int32),
        )  # fmt: skip


@register_kernel("staging", "step_inputs", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def step_inputs_reference(staged: StagedInputs, out: StepInputs | None = None) -> StepInputs:
    """The step's inputs by torch ops; written into `out` when given, else views and new tensors."""
    input_ids = staged.input_ids
    if staged.sources is not None:
        if staged.previous is None:
            raise RuntimeError("placeholder tokens but no previous samples to read them from")
        gathered = staged.previous.index_select(0, staged.sources.clamp(min=0)).to(input_ids.dtype)
        input_ids = torch.where(staged.sources >= 0, gathered, input_ids)
    table = staged.table[:, : staged.width]
    if staged.table_rows is not None:
        table = table.index_select(0, staged.table_rows)
    computed = StepInputs(
        input_ids, staged.positions, staged.slot_mapping,
        staged.seq_lens.to(torch.int32), staged.query_start.to(torch.int32), table.to(torch.int32),
    )  # fmt: skip
    if out is None:
        return computed
    for f in fields(StepInputs):
        getattr(out, f.name).copy_(getattr(computed, f.name))
    return out
