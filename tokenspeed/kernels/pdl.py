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

`TOKENSPEED_PDL=0` turns it off everywhere (the switch its tests flip);
it is off on the CPU, under Triton's interpreter and before sm_90.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch


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
