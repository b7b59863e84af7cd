"""Kernel layer: every hot op is resolved through the registry (see `registry.py`).

Families and modes: `attention.{decode,extend,paged}`, `kvstore.write`,
`norm.rms`, `rope.apply`, `activation.silu_and_mul`, `sampling.sample`. Each has
a torch REFERENCE (cpu and cuda) and a Triton PORTABLE kernel (cuda only; the
CPU keeps the reference). Triton kernels also run on CPU tensors under
`TRITON_INTERPRET=1` (tests), and `python -m tokenspeed.kernels.compile_check`
compiles them all for a GPU target on a machine without one.
"""

from tokenspeed.kernels.registry import (
    Band,
    KernelSelectionError,
    KernelSpec,
    SelectionReport,
    clear_kernel_overrides,
    describe_selection,
    list_kernels,
    platform_of,
    register_kernel,
    select_kernel,
    set_kernel_override,
    unregister_kernel,
)

__all__ = [
    "Band",
    "KernelSelectionError",
    "KernelSpec",
    "SelectionReport",
    "clear_kernel_overrides",
    "describe_selection",
    "list_kernels",
    "platform_of",
    "register_kernel",
    "select_kernel",
    "set_kernel_override",
    "unregister_kernel",
]
