"""`RequestPageTables`: incremental plans (rollbacks included) give the page tables a from-scratch build would."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenspeed.executor.batch_builder import RowSpec, StagingRing, build_host_batch, to_forward_batch
from tokenspeed.executor.page_tables import RequestPageTables
from tokenspeed.scheduler import ExecutionPlan, SamplingParams, ScheduledRow


def row(request_id: str, first: int, new: list[int], start: int, tokens: int = 1) -> ScheduledRow:
    return ScheduledRow(
        request_id=request_id, input_token_ids=[3] * tokens, start_position=start, first_new_page=first,
        new_page_ids=new, sampling=SamplingParams(), sample=True, seed=0, sample_index=0,
        prompt_token_ids=[], output_token_ids=[],
    )


def plans() -> list[tuple[ExecutionPlan, dict[str, list[int]]]]:
    """A few steps (grow, admit, release, re-admit under the same id, outgrow the table) and each
    step's full page lists."""
    wide = list(range(100, 100 + 70))  # more pages than the initial width
    return [
        (ExecutionPlan(1, [row("a", 0, [5, 6], 0, 7), row("b", 0, [9], 0, 3)]), {"a": [5, 6], "b": [9]}),
        (ExecutionPlan(2, [row("a", 2, [], 7), row("b", 1, [2], 3)]), {"a": [5, 6], "b": [9, 2]}),
        (ExecutionPlan(3, [row("b", 2, [], 4), row("a", 0, [7], 0, 2)], ["a"]), {"b": [9, 2], "a": [7]}),
        (ExecutionPlan(4, [row("c", 0, wide, 0, 4 * 70)], ["a", "b"]), {"c": wide}),
        # Rolled back (rejected drafts): c is cut to 65 pages, and d gets two of the pages c gave up.
        (ExecutionPlan(5, [row("c", 65, [300, 301], 4 * 66), row("d", 0, wide[66:68], 0, 5)]),
         {"c": wide[:65] + [300, 301], "d": wide[66:68]}),
    ]


def test_gathered_tables_equal_tables_built_from_scratch() -> None:
    tables = RequestPageTables(torch.device("cpu"), scratch_page=99, rows=2, width=4)
    for plan, expected in plans():
        slots = tables.apply(plan)
        specs = [RowSpec(r.input_token_ids, r.start_position) for r in plan.rows]
        host = build_host_batch(specs, 4, [], tables=tables, table_slots=slots, pad_rows_to=len(specs) + 1, scratch_page=99)
        batch = to_forward_batch(host, StagingRing(torch.device("cpu")), 4, tables=tables)
        scratch = [RowSpec(r.input_token_ids, r.start_position, expected[r.request_id]) for r in plan.rows]
        reference = build_host_batch(scratch, 4, [], pad_rows_to=len(specs) + 1, scratch_page=99)
        assert reference.page_table is not None
        assert torch.equal(batch.attn.page_table, torch.from_numpy(reference.page_table).to(torch.int32))
        assert np.array_equal(host.slot_mapping, reference.slot_mapping)
    assert tables.num_requests == 2 and int(tables.lengths.sum()) == 67 + 2 + 1  # c, d and the scratch slot


def test_updates_that_do_not_follow_the_held_table_raise() -> None:
    tables = RequestPageTables(torch.device("cpu"), scratch_page=0)
    tables.apply(ExecutionPlan(1, [row("a", 0, [1], 0)]))
    with pytest.raises(RuntimeError, match="adds pages at 2, but 1"):
        tables.apply(ExecutionPlan(2, [row("a", 2, [4], 5)]))
    with pytest.raises(RuntimeError, match="fresh page table without releasing"):
        tables.apply(ExecutionPlan(3, [row("a", 0, [1], 0)]))
    with pytest.raises(RuntimeError, match="not held"):
        tables.apply(ExecutionPlan(4, [], ["zz"]))


@pytest.mark.gpu
def test_the_device_copy_follows_the_host_table() -> None:
    device = torch.device("cuda")
    tables = RequestPageTables(device, scratch_page=99, rows=2, width=4)
    staging = StagingRing(device)
    for plan, expected in plans():
        slots = tables.apply(plan)
        specs = [RowSpec(r.input_token_ids, r.start_position) for r in plan.rows]
        batch = to_forward_batch(build_host_batch(specs, 4, [], tables=tables, table_slots=slots), staging, 4,
                                 tables=tables)
        width = max(len(p) for p in expected.values())
        want = [expected[r.request_id] + [0] * (width - len(expected[r.request_id])) for r in plan.rows]
        assert batch.attn.page_table.cpu().tolist() == want
