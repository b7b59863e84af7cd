"""Warm the GPU's L2 with weights a decode step is about to read, while the memory would idle.

A bs1 decode layer streams its weights in four GEMVs, but between the QKV
GEMV and o_proj run RoPE + KV store and attention, which at agent-turn
contexts of a few thousand tokens read a few MB and are bound by latency:
for those microseconds the DRAM sits mostly idle. `l2_prefetch` launches a
tiny kernel right after the QKV GEMV that asks the L2 for the first bytes of
the next weights (o_proj's, then gate/up's) with `prefetch.global.L2`
(no data comes back to the SM, nothing is written) and returns; the memory
system fills the L2 while RoPE and attention run, and o_proj then streams
from the L2. Bytes read from DRAM are the same; what changes is that they
are read while it would idle.

Launch order under PDL (`kernels/pdl.py`): the kernel issues its prefetches
before it waits for the QKV GEMV (weights never depend on it), lets the
next kernel be scheduled, and only then waits, so that the kernel after it
still sees the QKV output when its own wait returns.

How much: `TOKENSPEED_L2_PREFETCH` x the L2's size (default 0: off), read
per launch like the PDL switch; a fraction, since the L2 also holds what the
steps in between read, and fills on CUDA only (elsewhere this does nothing).
At long contexts attention's own reads evict the prefetched lines before
o_proj runs and the prefetch costs its bytes a second time (a few percent
of attention's reads there).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options

LINE_BYTES = 128  # an L2 cache line
_LINE = tl.constexpr(LINE_BYTES)
_LINES_PER_PROGRAM = 1024


def prefetch_fraction() -> float:
    """The part of the L2 `l2_prefetch` may fill (`TOKENSPEED_L2_PREFETCH`, 0 turns it off)."""
    return float(os.environ.get("TOKENSPEED_L2_PREFETCH", "0"))


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


@triton.jit
def _l2_prefetch_kernel(a_ptr, a_lines, b_ptr, b_lines, LINES: tl.constexpr, USE_PDL: tl.constexpr):
    """Lines [0, a_lines) of a, then [0, b_lines) of b (uint8 pointers), LINES a program."""
    line = tl.program_id(0) * LINES + tl.arange(0, LINES)
    line = tl.minimum(line, a_lines + b_lines - 1)  # the last program's spare lanes repeat the last line
    in_a = line < a_lines
    a_addr = a_ptr + tl.where(in_a, line, 0).to(tl.int64) * _LINE
    b_addr = b_ptr + tl.where(in_a, 0, line - a_lines).to(tl.int64) * _LINE
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [tl.where(in_a, a_addr, b_addr)],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
    if USE_PDL:  # the next kernel may be scheduled now; this one ends after the previous kernel
        gdc_launch_dependents()
        gdc_wait()


def lines_within(sizes: Sequence[int], budget: int) -> list[int]:
    """Whole L2 lines of each tensor (`sizes` in bytes) to prefetch, in order, `budget` bytes in all."""
    lines = []
    for size in sizes:
        take = min(budget, size) // LINE_BYTES
        lines.append(take)
        budget -= take * LINE_BYTES
    return lines


def l2_prefetch(tensors: Sequence[torch.Tensor]) -> None:
    """Ask the L2 for the first bytes of `tensors` (up to two, in order), at most the configured
    part of the L2 in all; returns at once. Does nothing off CUDA or when the switch is 0."""
    fraction = prefetch_fraction()
    if fraction <= 0 or not tensors or tensors[0].device.type != "cuda":
        return
    device = tensors[0].device
    budget = int(fraction * _l2_bytes(device.index if device.index is not None else torch.cuda.current_device()))
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors[:2]]
    lines = lines_within([t.numel() for t in flat], budget)
    if len(flat) == 1:
        flat, lines = flat * 2, lines + [0]
    total = lines[0] + lines[1]
    if total == 0:
        return
    _l2_prefetch_kernel[(triton.cdiv(total, _LINES_PER_PROGRAM),)](
        flat[0], lines[0], flat[1], lines[1], LINES=_LINES_PER_PROGRAM, num_warps=4,
        **pdl_launch_options(pdl_enabled(device)),
    )  # fmt: skip
