"""Triton block-scaled FP8 GEMM (`gemm.fp8`, name "triton"): prefill and large batches on tensor cores.

The DeepSeek-V3 recipe: activations are quantised per token and group of 128
(`quant.per_token_group`, one launch), weights carry a scale per 128 x 128
block, and the product runs fp8 x fp8 on Hopper's tensor cores. K is walked
128 at a time, exactly one activation group and one weight scale column:
each step's `tl.dot` starts from zero and its fp32 result is multiplied by
the row scales of A and the column scales of B before it is added to the
accumulator. Besides applying the scales, this bounds how long the tensor
cores accumulate on their own (fp8 wgmma accumulates with reduced precision;
DeepSeek-V3 promotes to fp32 every 128 values for that reason).

Scales of any `block_size` are gathered per output column (`n // bn`), so the
same kernel serves block, per-channel ((1, K)) and per-tensor ((N, K)) weights;
where a tile's columns lie in one row block (`ONE_B_SCALE`: 128 x 128 blocks
and 128-wide tiles) the step's two scales fold into one per row, one FMA per
accumulator element instead of three operations.
Rows and columns past M and N are read wrapped (`% M`, `% N`) instead of
masked, and dropped at the store. Program order is grouped (`GROUP_M` row
blocks per weight column tile) so tiles of B are reused from L2.

Tiles (`choose_tiles`): 64-row tiles on one warpgroup up to 256 tokens
(wgmma's native height), 128 x 128 on two warpgroups above; not tuned one by
one yet: `benchmarks/fp8_kernels.py --sweep` measures the alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.gemm.fp8_reference import check_fp8_gemm_args
from tokenspeed.kernels.quant.fp8 import GROUP_SIZE, WEIGHT_BLOCK, BlockSize
from tokenspeed.kernels.quant.quantize_triton import quantize_per_token_group_triton
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor


@dataclass(frozen=True, slots=True)
class Fp8GemmTiles:
    """Launch shape of `_fp8_gemm_kernel`; K steps are always one 128-wide scale group."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def choose_tiles(m: int) -> Fp8GemmTiles:
    """Tiles for `m` tokens: one warpgroup of 64 rows for small batches, 128 x 128 on two above 256."""
    if m <= 256:
        return Fp8GemmTiles(block_m=64, block_n=128, num_warps=4, num_stages=4)
    return Fp8GemmTiles(block_m=128, block_n=128, num_warps=8, num_stages=3)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_B_SCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m % M
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    a_scales = a_scale_ptr + rows.to(tl.int64) * stride_asm
    b_scales = b_scale_ptr + (cols // SCALE_BN) * stride_bsn
    tile_scales = b_scale_ptr + ((pid_n * BLOCK_N) // SCALE_BN) * stride_bsn  # the tile's row block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - step * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_s = tl.load(a_scales + step)
        if ONE_B_SCALE:  # one weight scale for the whole tile: one FMA an element to scale and accumulate
            acc += tl.dot(a, b) * (a_s * tl.load(tile_scales + (step * BLOCK_K) // SCALE_BK))[:, None]
        else:
            b_s = tl.load(b_scales + (step * BLOCK_K) // SCALE_BK)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    out = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def fp8_gemm_prequantized(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    block_size: BlockSize,
    bias: torch.Tensor | None = None,
    tiles: Fp8GemmTiles | None = None,
) -> torch.Tensor:
    """out `[M, N]` = (a * a_scale) (weight * weight_scale)^T (+ bias); a fp8 `[M, K]`, a_scale `[M, K/128]`."""
    m, k = a.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return out
    tiles = tiles or choose_tiles(m)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    for_tensor(_fp8_gemm_kernel, a)[grid](
        a, a_scale, weight, weight_scale, bias if bias is not None else out, out, m, n, k,
        a.stride(0), a_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        SCALE_BN=block_size[0], SCALE_BK=max(block_size[1], GROUP_SIZE), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=GROUP_SIZE, GROUP_M=tiles.group_m, HAS_BIAS=bias is not None,
        ONE_B_SCALE=block_size[0] % tiles.block_n == 0 and n % tiles.block_n == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


@register_kernel("gemm", "fp8", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES)
def fp8_gemm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_size: BlockSize = WEIGHT_BLOCK,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    tiles: Fp8GemmTiles | None = None,
) -> torch.Tensor:
    """Quantise x per token group, then the block-scaled fp8 GEMM; see `fp8_reference.fp8_gemm_reference`."""
    n, k = check_fp8_gemm_args(x, weight, weight_scale, block_size)
    if weight.stride(-1) != 1:
        raise ValueError("the weight must be contiguous along K")
    a, a_scale = quantize_per_token_group_triton(x.reshape(-1, k))
    out = torch.empty(a.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    fp8_gemm_prequantized(
        a, a_scale, weight, weight_scale, out, block_size=block_size, bias=bias, tiles=tiles
    )
    return out.view(*x.shape[:-1], n)
