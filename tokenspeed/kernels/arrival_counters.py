"""Zeroed int32 arrival counters for kernels whose last program to finish does the final step.

A split-K GEMM (`gemm/fp8_skinny_triton.py`) splits one output over several
programs (a split-KV decode merging this way, commit e26eafa, was measured
slower than its merge kernel and stays reverted). Rather than a second kernel that merges their partials, each
program stores its partial, then counts its arrival on the output's counter
(an acq_rel atomic); the program that arrives last merges the partials in
split order (so the result does not depend on which came last), writes the
output and sets the counter back to zero for the next launch.

One buffer per device, shared by every such launch: launches on one device
run one after another (the engine's single compute stream; with programmatic
dependent launch a kernel touches counters only after it has waited for the
previous one), and each leaves the counters zero. The buffer is made on the
first eager call, never inside a CUDA graph capture (it would belong to the
graph's memory pool and be zeroed by its replays); the engine's warm-up runs
every batch size eagerly before capturing it, and a capture that comes first
gets None, so the kernel takes its unsplit form.
"""

from __future__ import annotations

import torch

CAPACITY = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """At least `needed` zeroed counters on `device`, or None (inside a first capture, or too many)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
    return counters if needed <= counters.numel() else None


def all_at_rest() -> bool:
    """Whether every counter is zero (each launch reset the ones it used): for tests."""
    return all(not counters.any() for counters in _COUNTERS.values())
