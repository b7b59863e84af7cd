"""Random `staging.step_inputs` cases, shared by the interpreter and GPU tests (no triton import here)."""

from __future__ import annotations

from dataclasses import fields

import torch

from tokenspeed.kernels.staging.step_inputs import StagedInputs, StepInputs


def staged_case(
    tokens: int, rows: int, width: int, placeholders: bool, request_table: bool, device: str = "cpu"
) -> StagedInputs:
    """Random arrays of a step: every other token a placeholder (if any), table rows drawn from a taller
    request table (if `request_table`) wider than `width`."""
    g = torch.Generator().manual_seed(tokens * 31 + rows)
    starts = torch.sort(torch.randint(0, tokens + 1, (rows - 1,), generator=g)).values
    sources = None
    if placeholders:
        sources = torch.where(torch.arange(tokens) % 2 == 0, torch.randint(0, 6, (tokens,), generator=g), -1)
    table_rows = torch.randint(0, 2 * rows + 3, (rows,), generator=g) if request_table else None
    table_height = 2 * rows + 3 if request_table else rows
    staged = StagedInputs(
        input_ids=torch.randint(0, 50_000, (tokens,), generator=g),
        positions=torch.randint(0, 1 << 17, (tokens,), generator=g),
        slot_mapping=torch.randint(0, 1 << 20, (tokens,), generator=g),
        seq_lens=torch.randint(1, 1 << 17, (rows,), generator=g),
        query_start=torch.cat([torch.tensor([0]), starts, torch.tensor([tokens])]),
        # wider than the step needs; int32 as the request tables on a GPU, int64 as an uploaded table
        table=torch.randint(0, 1 << 20, (table_height, width + 5), generator=g).to(torch.int32 if request_table else torch.int64),
        table_rows=table_rows,
        width=width,
        sources=sources,
        previous=torch.randint(60_000, 70_000, (6,), generator=g) if placeholders else None,
    )
    moved = {f.name: getattr(staged, f.name) for f in fields(StagedInputs)}
    return StagedInputs(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def assert_same_inputs(got: StepInputs, want: StepInputs) -> None:
    for f in fields(StepInputs):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a.dtype == b.dtype and torch.equal(a, b), f.name


