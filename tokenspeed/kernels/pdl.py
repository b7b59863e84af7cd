"""Programmatic dependent launch (PDL) for the decode-step kernels, with one off switch.

A decode step at batch 1 is ~200 short kernels in a CUDA graph; each one's
launch, ramp-up and tail leave the GPU partly idle. With PDL (Hopper and
newer) a kernel may be scheduled while its predecessor is still running:
kernels launched this way call `griddepcontrol.launch_dependents` early (the
next kernel may be scheduled once all our programs have started) and
`griddepcontrol.wait` before they touch anything the previous kernel writes
or reads (the wait returns once the previous grid has completed and its
memory is visible). So every global write still happens after every earlier
kernel has finished: the order of effects is the same as without PDL, only
scheduling and independent loads (a GEMV's weights) move earlier.

What a kernel may read before its wait: anything its predecessor does not
write. Every kernel here lets its dependents start only after its own wait,
so when a kernel starts, every kernel before its predecessor has completed.
Hence weights, and a row's positions, slots, length and page table (copied
by the host or computed by a draft chain's kernels before the layers run),
and the keys and values of earlier positions: rope_write and the decode
attention read these before the wait (a step shorter by ~1% at bs1, H100:
`benchmarks/results/h100/wave2/attn_pre_wait_2026-12-07/`).
`prefetch_rows_l2` asks the L2 for rows without holding registers for them,
so that the loads after the wait hit the L2; the L2 is coherent, so a line
the predecessor then writes is read new after the wait.

RMSNorm and SiLU-and-mul (the kernels a decode layer of 2-16 rows runs
between its GEMMs) launch with PDL too, so that their launch overlaps the
GEMM before them, but never trigger: their dependents launch as they end.
Triggered early, the FP8 skinny GEMM after a norm launched its programs to
wait on SMs and Llama-3.1-8B FP8 at 16 rows was 2.3% slower; untriggered,
FP8 and bf16 at 2 and 16 rows were 0.5-2.8% faster in every pair (H100,
`benchmarks/results/h100/wave2/pdl_norm_act_2026-12-07/`).

`TOKENSPEED_PDL=0` turns it off everywhere (the switch its tests flip);
it is off on the CPU, under Triton's interpreter and before sm_90.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (read per launch, so the switch works at run time)."""
    if device.type != "cuda" or os.environ.get("TOKENSPEED_PDL", "1") == "0":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch_options(enabled: bool) -> dict[str, Any]:
    """Extra launch keywords for a Triton kernel with a `USE_PDL` constexpr."""
    return {"USE_PDL": enabled, "launch_pdl": True} if enabled else {"USE_PDL": False}


@triton.jit
def prefetch_rows_l2(row_ptrs, ROW_BYTES: tl.constexpr):
    """Ask the L2 for every 128-byte line of `ROW_BYTES` (a power of two) from each of `row_ptrs`
    (`prefetch.global.L2`: nothing comes back to the SM, no register waits on it)."""
    ELEMS_PER_LINE: tl.constexpr = 1024 // row_ptrs.dtype.element_ty.primitive_bitwidth
    LINES: tl.constexpr = (ROW_BYTES + 127) // 128
    lines = row_ptrs[:, None] + (tl.arange(0, LINES) * ELEMS_PER_LINE)[None, :]
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [lines], dtype=tl.int32, is_pure=False, pack=1
    )
