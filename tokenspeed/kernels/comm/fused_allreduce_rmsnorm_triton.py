"""Triton `comm.fused_allreduce_rmsnorm`: sum every rank's addend, add the residual, RMSNorm, in one pass.

One program per token row: it reads the row from each rank's buffer (the
buffers are a tuple argument of the launch, one pointer per rank, so the
same kernel reads peers' memory mapped over NVLink or, on one GPU, the
slices of a stacked tensor), sums in
fp32 in rank order, rounds to the activation dtype (what an all-reduce would
leave), adds the residual, writes that sum (the new residual stream), then
normalises as `norm.rms` does and writes the output. So the partial sums are
read once and nothing else round-trips through memory: the all-reduce, the
add and the norm cost one kernel.

Every rank runs it over all rows (a one-shot all-reduce): the right shape for
decode-sized batches, where an NCCL ring is latency-bound. Peers must have
written their addends first (the caller's barrier on the symmetric buffers).

Nothing but the launch happens on the host: the peers' addresses travel as
kernel arguments. (An earlier version copied a pointer table to the device
on every call; that pageable host-to-device copy synchronised the stream, so
each call waited for all queued work and then paid its own launch latency on
an idle GPU: a fixed ~45 us on the H200, more than the unfused ops. It also
could not be captured in a CUDA graph.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.comm.partial_sums import PartialSums
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2

_MAX_HIDDEN = 65536


@triton.jit
def _fused_allreduce_rmsnorm_kernel(
    peers,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    eps,
    stride_row,
    stride_res_row,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    WORLD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = peers[0].dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for w in tl.static_range(WORLD):
        acc += tl.load(peers[w] + r * stride_row + offs, mask=mask, other=0.0).to(tl.float32)
    x = acc.to(dtype)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + r * stride_res_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(summed_ptr + r * N + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    normed = (h * rstd).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * N + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _row_stride(t: torch.Tensor, what: str) -> int:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{what} must be [tokens, hidden] with unit stride in hidden, got {tuple(t.shape)}")
    return t.stride(0)


@register_kernel(
    "comm",
    "fused_allreduce_rmsnorm",
    name="triton",
    band=Band.PORTABLE,
    platforms=("cuda",),
    dtypes=FLOAT_DTYPES,
    traits={"transport": ("peer_buffers",)},
)
def fused_allreduce_rmsnorm_triton(
    partials: PartialSums, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual) from peer buffers; world size 1 reads `local` alone."""
    if not partials.peers and partials.world_size > 1:
        raise ValueError("the Triton fused all-reduce reads peer buffers; this PartialSums has only a process group")
    peers = partials.peers or (partials.local,)
    x = peers[0]
    stride = _row_stride(x, "an addend")
    for peer in peers[1:]:
        if peer.shape != x.shape or peer.dtype != x.dtype or peer.stride() != x.stride():
            raise ValueError("every rank's addend must have the same shape, dtype and strides")
    rows, n = x.shape
    if n > _MAX_HIDDEN:
        raise ValueError(f"fused_allreduce_rmsnorm_triton handles rows up to {_MAX_HIDDEN} wide, got {n}")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != addend shape {tuple(x.shape)}")
    if rows:
        block = next_power_of_2(n)
        for_tensor(_fused_allreduce_rmsnorm_kernel, x)[(rows,)](
            tuple(peers),
            x if residual is None else residual,
            weight,
            out,
            summed,
            eps,
            stride,
            0 if residual is None else _row_stride(residual, "residual"),
            N=n,
            BLOCK=block,
            WORLD=len(peers),
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return out, summed
