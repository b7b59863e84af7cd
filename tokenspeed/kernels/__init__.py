"""Kernel layer: every hot op is resolved through the registry (see `registry.py`)."""

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
