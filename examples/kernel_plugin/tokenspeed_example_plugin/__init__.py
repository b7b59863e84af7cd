"""An example TokenSpeed kernel plugin: gated SiLU written as one sigmoid and two products.

Installing this package (`pip install examples/kernel_plugin`) adds the kernel
`activation.silu_and_mul=example_plugin` in the PLUGIN band, the highest, so
the registry picks it over the built-ins wherever it is eligible (CPU and
CUDA, every dtype). `tokenspeed kernels --family activation` shows it, and
`--kernel activation.silu_and_mul=reference` (or
`TOKENSPEED_KERNEL_ACTIVATION_SILU_AND_MUL=reference`) switches it off.

Registration happens in `register()`, the entry point, not at import, so
importing the package has no side effect of its own.
"""

from __future__ import annotations

import torch

KERNEL_NAME = "example_plugin"


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:], the contract of `activation.silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def register() -> None:
    from tokenspeed.kernels.registry import Band, register_kernel

    register_kernel(
        "activation",
        "silu_and_mul",
        name=KERNEL_NAME,
        band=Band.PLUGIN,
        platforms=("cpu", "cuda"),
        impl=silu_and_mul,
    )
