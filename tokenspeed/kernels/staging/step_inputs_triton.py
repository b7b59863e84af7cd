"""Triton `staging.step_inputs`: a step's device inputs from its upload in one launch (see `step_inputs.py`).

Program p copies tokens `[p * BLOCK, (p + 1) * BLOCK)` (resolving placeholders
from the previous step's samples), the same range of row lengths and query
starts (cast to int32), and then the page-table rows p, p + G, ... (G
programs), each gathered from its row of the source table in BLOCK-column
pieces. At decode sizes that is one program a row, all in one wave.
"""

from __future__ import annotations

from dataclasses import fields

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.staging.step_inputs import StagedInputs, StepInputs
from tokenspeed.kernels.triton_launch import for_tensor

BLOCK = 512


@triton.jit
def _step_inputs_kernel(
    ids_ptr, pos_ptr, slot_ptr, seq_ptr, qs_ptr, src_ptr, prev_ptr, table_ptr, table_rows_ptr,
    out_ids_ptr, out_pos_ptr, out_slot_ptr, out_seq_ptr, out_qs_ptr, out_table_ptr,
    num_tokens, num_rows, width, stride_table, stride_out_table,
    HAS_SOURCES: tl.constexpr, HAS_TABLE_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    is_token = offs < num_tokens
    ids = tl.load(ids_ptr + offs, mask=is_token, other=0)
    if HAS_SOURCES:
        source = tl.load(src_ptr + offs, mask=is_token, other=-1)
        sampled = tl.load(prev_ptr + tl.maximum(source, 0), mask=source >= 0, other=0)
        ids = tl.where(source >= 0, sampled.to(tl.int64), ids)
    tl.store(out_ids_ptr + offs, ids, mask=is_token)
    tl.store(out_pos_ptr + offs, tl.load(pos_ptr + offs, mask=is_token), mask=is_token)
    tl.store(out_slot_ptr + offs, tl.load(slot_ptr + offs, mask=is_token), mask=is_token)
    is_row = offs < num_rows
    tl.store(out_seq_ptr + offs, tl.load(seq_ptr + offs, mask=is_row).to(tl.int32), mask=is_row)
    is_start = offs <= num_rows
    tl.store(out_qs_ptr + offs, tl.load(qs_ptr + offs, mask=is_start).to(tl.int32), mask=is_start)
    columns = tl.arange(0, BLOCK)
    for row in range(pid, num_rows, tl.num_programs(0)):
        source_row = tl.cast(row, tl.int64)
        if HAS_TABLE_ROWS:
            source_row = tl.load(table_rows_ptr + row).to(tl.int64)
        for c0 in range(0, width, BLOCK):
            in_width = c0 + columns < width
            pages = tl.load(table_ptr + source_row * stride_table + c0 + columns, mask=in_width)
            out_row = out_table_ptr + tl.cast(row, tl.int64) * stride_out_table
            tl.store(out_row + c0 + columns, pages.to(tl.int32), mask=in_width)


@register_kernel("staging", "step_inputs", name="triton", band=Band.PORTABLE, platforms=("cuda",))
def step_inputs_triton(staged: StagedInputs, out: StepInputs | None = None) -> StepInputs:
    """`step_inputs_reference`'s result in one launch (written into `out` when given)."""
    if staged.sources is not None and staged.previous is None:
        raise RuntimeError("placeholder tokens but no previous samples to read them from")
    num_tokens, num_rows, width = int(staged.input_ids.shape[0]), staged.num_rows, staged.width
    if out is None:
        out = StepInputs.empty(num_tokens, num_rows, width, staged.input_ids.device)
    tensors = [getattr(x, f.name) for x in (staged, out) for f in fields(x)]
    assert all(t.stride(-1) == 1 for t in tensors if isinstance(t, torch.Tensor)), "rows must be contiguous"
    table = staged.table
    sources = staged.sources if staged.sources is not None else staged.input_ids
    previous = staged.previous if staged.previous is not None else staged.input_ids
    table_rows = staged.table_rows if staged.table_rows is not None else staged.input_ids
    programs = max(triton.cdiv(num_tokens, BLOCK), triton.cdiv(num_rows + 1, BLOCK), num_rows, 1)
    for_tensor(_step_inputs_kernel, staged.input_ids)[(programs,)](
        staged.input_ids, staged.positions, staged.slot_mapping, staged.seq_lens, staged.query_start,
        sources, previous, table, table_rows,
        out.input_ids, out.positions, out.slot_mapping, out.seq_lens, out.query_start, out.page_table,
        num_tokens, num_rows, width, table.stride(0), out.page_table.stride(0),
        HAS_SOURCES=staged.sources is not None, HAS_TABLE_ROWS=staged.table_rows is not None, BLOCK=BLOCK,
        num_warps=4,
    )  # fmt: skip
    return out
