"""The collectives the compiled plan names, over a `GroupHandle`; each a no-op on a group of one rank.

So the same model code runs at world size 1 (nothing is called, not even
torch.distributed) and N. Shards are equal-sized: the caller pads (the
multi-rank executor pads each attention-DP group's tokens to the largest
group's count, since reduce-scatter and all-gather need equal shards).

`fused_allreduce_rmsnorm` is chosen through the kernel registry once, at
build time, by transport: `process_group` (gloo, NCCL: the reference,
all-reduce then norm) or `peer_buffers` (the Triton kernel that reads the
peers' addends itself).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenspeed.kernels.comm.partial_sums import PartialSums
from tokenspeed.kernels.registry import KernelSpec, platform_of, select_kernel
from tokenspeed.placement.process_groups import GroupHandle

# torch 2.13 renamed the tensor forms; the GPU machine's 2.11 has only the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """The sum over the group, in place in `x` (returned)."""
    if group.size > 1:
        dist.all_reduce(x, group=group.process_group)
    return x


def all_gather(x: torch.Tensor, group: GroupHandle, dim: int = 0) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in group order."""
    if group.size == 1:
        return x
    rows = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_tensor(rows, x.contiguous(), group=group.process_group)  # rank i's x at rows [i*n, (i+1)*n)
    if dim in (0, -x.dim()):
        return rows
    return torch.cat(rows.chunk(group.size, dim=0), dim=dim)


def reduce_scatter(x: torch.Tensor, group: GroupHandle, dim: int = 0) -> torch.Tensor:
    """This rank's 1/size slice along `dim` of the sum over the group."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(f"reduce_scatter: dimension {dim} of {tuple(x.shape)} does not split into {group.size}")
    rows = x.contiguous() if dim in (0, -x.dim()) else torch.cat(x.chunk(group.size, dim=dim), dim=0)
    out = torch.empty((rows.shape[0] // group.size, *rows.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_tensor(out, rows, group=group.process_group)  # rows [i*n, (i+1)*n) reduce onto rank i
    return out


def all_to_all(
    x: torch.Tensor, group: GroupHandle, send_counts: list[int], receive_counts: list[int]
) -> torch.Tensor:
    """Rows [sum(send_counts[:i]), ...) of `x` go to rank i; returns the rows received, in rank order."""
    if group.size == 1:
        return x
    out = torch.empty((sum(receive_counts), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), receive_counts, send_counts, group=group.process_group)
    return out


def partial_sums(x: torch.Tensor, group: GroupHandle) -> PartialSums:
    """`x` as this rank's addend of a pending sum over `group` (process-group transport)."""
    return PartialSums(local=x, group=group.process_group if group.size > 1 else None)


def select_fused_allreduce_rmsnorm(
    device: torch.device | str, dtype: torch.dtype, transport: str = "process_group"
) -> KernelSpec:
    """The `comm.fused_allreduce_rmsnorm` kernel for this device, dtype and transport (build time)."""
    return select_kernel(
        "comm",
        "fused_allreduce_rmsnorm",
        platform=platform_of(device),
        dtype=dtype,
        traits={"transport": transport},
    )
