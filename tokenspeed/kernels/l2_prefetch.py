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

LINE_BYTES = 128  # an L2 cache line: `prefetch.global.L2` asks for one
BULK_BYTES = 4096  # what one `cp.async.bulk.prefetch.L2` asks for here (the copy engine splits it)
_UNITS_PER_PROGRAM = 1024


def prefetch_fraction() -> float:
    """The part of the L2 `l2_prefetch` may fill (`TOKENSPEED_L2_PREFETCH`, 0 turns it off)."""
    return float(os.environ.get("TOKENSPEED_L2_PREFETCH", "0"))


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


@triton.jit
def _l2_prefetch_kernel(a_ptr, a_units, b_ptr, b_units, UNITS: tl.constexpr, UNIT_BYTES: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Units [0, a_units) of a, then [0, b_units) of b (uint8 pointers), UNITS a program; a unit is a
    line (`prefetch.global.L2`) or, for UNIT_BYTES > 128, a bulk request of that many bytes."""
    unit = tl.program_id(0) * UNITS + tl.arange(0, UNITS)
    unit = tl.minimum(unit, a_units + b_units - 1)  # the last program's spare lanes repeat the last unit
    in_a = unit < a_units
    a_addr = a_ptr + tl.where(in_a, unit, 0).to(tl.int64) * UNIT_BYTES
    b_addr = b_ptr + tl.where(in_a, 0, unit - a_units).to(tl.int64) * UNIT_BYTES
    addr = tl.where(in_a, a_addr, b_addr)
    if UNIT_BYTES > 128:
        tl.inline_asm_elementwise(
            "mov.u32 $0, 0;\n\tcp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
            [addr, tl.full([UNITS], UNIT_BYTES, tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.inline_asm_elementwise(
            "mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1
        )
    if USE_PDL:  # the next kernel may be scheduled now; this one ends after the previous kernel
        gdc_launch_dependents()
        gdc_wait()


def units_within(sizes: Sequence[int], budget: int, unit: int = LINE_BYTES) -> list[int]:
    """Whole units of each tensor (`sizes` in bytes) to prefetch, in order, `budget` bytes in all."""
    units = []
    for size in sizes:
        take = min(budget, size) // unit
        units.append(take)
        budget -= take * unit
    return units


def l2_prefetch(tensors: Sequence[torch.Tensor]) -> None:
    """Ask the L2 for the first bytes of `tensors` (up to two, in order), at most the configured
    part of the L2 in all; returns at once. Does nothing off CUDA or when the switch is 0."""
    fraction = prefetch_fraction()
    if fraction <= 0 or not tensors or tensors[0].device.type != "cuda":
        return
    device = tensors[0].device
    budget = int(fraction * _l2_bytes(device.index if device.index is not None else torch.cuda.current_device()))
    unit = BULK_BYTES if os.environ.get("TOKENSPEED_L2_PREFETCH_BULK", "0") == "1" else LINE_BYTES
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors[:2]]
    units = units_within([t.numel() for t in flat], budget, unit)
    if len(flat) == 1:
        flat, units = flat * 2, units + [0]
    total = units[0] + units[1]
    if total == 0:
        return
    _l2_prefetch_kernel[(triton.cdiv(total, _UNITS_PER_PROGRAM),)](
        flat[0], units[0], flat[1], units[1], UNITS=_UNITS_PER_PROGRAM, UNIT_BYTES=unit, num_warps=4,
        **pdl_launch_options(pdl_enabled(device)),
    )  # fmt: skip
