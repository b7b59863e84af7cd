"""`staging.step_inputs` (`kernels/staging/`): the Triton kernel, under Triton's interpreter, against the torch
REFERENCE, bit for bit: placeholders resolved from the previous step's samples, page-table rows gathered from
a request table or taken from an uploaded one, int32 lengths, several programs (more tokens and columns than
one block), and writes into views of wider buffers (a CUDA graph's static inputs) that leave the rest alone;
and `to_forward_batch` giving the same batch with and without such buffers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.staging_cases import assert_same_inputs, staged_case
from tests.test_page_tables import row
from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.executor.batch_builder import RowSpec, StagingRing, build_host_batch, to_forward_batch
from tokenspeed.executor.page_tables import RequestPageTables
from tokenspeed.kernels.staging.step_inputs import StepInputs, step_inputs_reference
from tokenspeed.kernels.staging.step_inputs_triton import BLOCK, step_inputs_triton
from tokenspeed.scheduler import ExecutionPlan
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)


@interpreted
@pytest.mark.parametrize("placeholders", [False, True])
@pytest.mark.parametrize("request_table", [False, True])
@pytest.mark.parametrize("tokens, rows, width", [(1, 1, 1), (5, 3, 7), (BLOCK + 9, 4, BLOCK + 3), (3, 3, 2)])
def test_step_inputs_kernel_equals_the_reference(
    placeholders: bool, request_table: bool, tokens: int, rows: int, width: int
) -> None:
    staged = staged_case(tokens, rows, width, placeholders, request_table)
    want = step_inputs_reference(staged)
    if placeholders:
        assert staged.sources is not None and bool((staged.sources >= 0).any())
        assert not torch.equal(want.input_ids, staged.input_ids)  # the case does resolve placeholders
    assert_same_inputs(step_inputs_triton(staged), want)

    # into views of wider buffers, as a CUDA graph's static inputs: the rest stays as it was
    ids, pos, slots = (torch.full((tokens + 4,), -7) for _ in range(3))
    lens, starts = torch.full((rows + 2,), -7, dtype=torch.int32), torch.full((rows + 3,), -7, dtype=torch.int32)
    table = torch.full((rows + 2, width + 6), -7, dtype=torch.int32)
    out = StepInputs(ids[:tokens], pos[:tokens], slots[:tokens], lens[:rows], starts[: rows + 1],
                     table[:rows, :width])  # fmt: skip
    assert step_inputs_triton(staged, out) is out
    assert_same_inputs(out, want)
    untouched = [ids[tokens:], pos[tokens:], slots[tokens:], lens[rows:], starts[rows + 1 :], table[rows:],
                 table[:, width:]]  # fmt: skip
    assert all(bool((t == -7).all()) for t in untouched)


@interpreted
def test_step_inputs_kernel_requires_previous_samples_for_placeholders() -> None:
    staged = staged_case(4, 2, 3, placeholders=True, request_table=False)
    staged.previous = None
    with pytest.raises(RuntimeError, match="no previous samples"):
        step_inputs_triton(staged)
    with pytest.raises(RuntimeError, match="no previous samples"):
        step_inputs_reference(staged)


def test_to_forward_batch_into_given_buffers_gives_the_same_batch() -> None:
    """Request tables with a placeholder token and graph padding, resolved into new tensors and into views of
    wider buffers (what the runner passes when a CUDA graph runs the step): same numbers, and the views hold them."""
    tables = RequestPageTables(torch.device("cpu"), scratch_page=9, rows=4, width=4)
    placeholder_row = dataclasses.replace(row("b", 0, [3, 4], 4), input_token_ids=[PLACEHOLDER_TOKEN_ID])
    plan = ExecutionPlan(1, [row("a", 0, [1, 2], 0, tokens=3), placeholder_row])
    slots = tables.apply(plan)
    host = build_host_batch(
        [RowSpec(r.input_token_ids, r.start_position) for r in plan.rows], 4, [2, 3],
        placeholder_source={"b": 1}, row_ids=["a", "b"], pad_rows_to=4, scratch_page=9, tables=tables,
        table_slots=slots,
    )  # fmt: skip
    staging, previous = StagingRing(torch.device("cpu")), torch.tensor([70, 71])
    plain = to_forward_batch(host, staging, 4, previous, tables)
    buffers = StepInputs.empty(16, 8, 6, torch.device("cpu"))
    out = StepInputs(buffers.input_ids[:6], buffers.positions[:6], buffers.slot_mapping[:6], buffers.seq_lens[:4],
                     buffers.query_start[:5], buffers.page_table[:4, :2])  # fmt: skip
    placed = to_forward_batch(host, staging, 4, previous, tables, out=out)
    assert plain.input_ids.tolist() == [3, 3, 3, 71, 0, 0]
    assert plain.attn.page_table.tolist() == [[1, 2], [3, 4], [9, 0], [9, 0]]
    for got, want in [
        (placed.input_ids, plain.input_ids), (placed.positions, plain.positions),
        (placed.attn.slot_mapping, plain.attn.slot_mapping), (placed.attn.seq_lens_tensor, plain.attn.seq_lens_tensor),
        (placed.attn.query_start_tensor, plain.attn.query_start_tensor), (placed.attn.page_table, plain.attn.page_table),
    ]:  # fmt: skip
        assert torch.equal(got, want)
    assert placed.input_ids.data_ptr() == buffers.input_ids.data_ptr()
    assert placed.attn.page_table.data_ptr() == buffers.page_table.data_ptr()
    assert np.array_equal(host.seq_lens, plain.attn.seq_lens_tensor.numpy())
