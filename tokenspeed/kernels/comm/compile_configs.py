"""`comm.fused_allreduce_rmsnorm` at serving shapes, for `tokenspeed.kernels.compile_check`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenspeed.kernels.compile_check import KernelConfig


def comm_compile_configs() -> Iterator[KernelConfig]:
    from tokenspeed.kernels.comm import fused_allreduce_rmsnorm_triton as fused
    from tokenspeed.kernels.compile_check import KernelConfig

    for world in (2, 8):
        yield KernelConfig(
            f"comm.fused_allreduce_rmsnorm world={world}",
            fused._fused_allreduce_rmsnorm_kernel,
            dict(N=4096, BLOCK=4096, WORLD=world, HAS_RESIDUAL=True),
            pointers={"peers": ("bf16",) * world},
            multiple_of_16=("stride_row", "stride_res_row"),
            num_warps=16,
        )
