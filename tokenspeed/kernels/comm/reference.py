"""Reference `comm.fused_allreduce_rmsnorm`: sum the addends, then the reference residual add + RMSNorm.

The oracle of the fused kernels and the CPU path. With a process group it
is exactly what an unfused engine does (all-reduce, then the norm); with peer
buffers it sums them in rank order in fp32 and rounds once to the activation
dtype, the order the Triton kernel follows, so the two agree to rounding of
the norm alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenspeed.kernels.comm.partial_sums import PartialSums
from tokenspeed.kernels.norm.rms_reference import rms_norm_reference
from tokenspeed.kernels.registry import Band, register_kernel


def reduce_partial_sums(partials: PartialSums) -> torch.Tensor:
    """The complete sum, as an all-reduce would leave it (activation dtype)."""
    if partials.peers:
        total = partials.peers[0].float()
        for addend in partials.peers[1:]:
            total = total + addend.float()
        return total.to(partials.local.dtype)
    if partials.group is not None and dist.get_world_size(partials.group) > 1:
        dist.all_reduce(partials.local, group=partials.group)
    return partials.local


@register_kernel(
    "comm", "fused_allreduce_rmsnorm", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda")
)
def fused_allreduce_rmsnorm_reference(
    partials: PartialSums, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual); without a residual the sum itself becomes the residual."""
    total = reduce_partial_sums(partials)
    if residual is None:
        return rms_norm_reference(total, weight, eps), total
    return rms_norm_reference(total, weight, eps, residual)
