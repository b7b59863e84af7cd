"""Triton dynamic FP8 activation quantisation: `quant.per_token_group` (1 x 128) and `quant.per_token` (rowwise).

`per_token_group`, the input of the block-scaled GEMMs: a program quantises
`GROUPS` groups of 128 values of one row: loads them once, takes each
group's amax, and writes the fp8 values and the group's scale (amax / 448,
as `fp8.quantize_per_token_group`, to the bit: divisions are rounded like
torch's, `div_rn`, and the cast is `fp8_cast.to_fp8`). Scales can be written
column-major (`column_major_scales`), the layout cuBLAS wants for 1 x 128
scales (`gemm/fp8_scaled_mm.py`), at no cost.

`per_token`, the input of rowwise-scaled GEMMs (per-channel weights): one
program a row, two passes (the row's amax, then the values), same rounding.

Both are bound by memory (2 bytes read, 1 byte + a little written per value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, FP8_MAX, GROUP_SIZE, MIN_AMAX
from tokenspeed.kernels.quant.fp8_cast import to_fp8
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2

_VALUES_PER_PROGRAM = 2048


@triton.jit
def _per_token_group_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    num_groups,
    stride_x,
    stride_q,
    stride_s,
    stride_sg,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    MIN_SCALED_AMAX: tl.constexpr,
    MAX_FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), MIN_SCALED_AMAX)
    scale = tl.math.div_rn(amax, MAX_FP8)
    inverse = tl.math.div_rn(tl.full([GROUPS], 1.0, tl.float32), scale)
    tl.store(q_ptr + row * stride_q + cols, to_fp8(x * inverse[:, None]), mask=mask)
    tl.store(scale_ptr + row * stride_s + groups * stride_sg, scale, mask=groups < num_groups)


@register_kernel(
    "quant", "per_token_group", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def quantize_per_token_group_triton(
    x: torch.Tensor, group_size: int = GROUP_SIZE, *, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., K]` -> (fp8 `[..., K]`, fp32 scales `[..., ceil(K / group_size)]`); see `fp8.quantize_per_token_group`.

    `column_major_scales`: the `[rows, groups]` scales are stored column by
    column (strides `(1, rows)`; 2-D x only).
    """
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_groups = -(-k // group_size)
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=x.device)
    if column_major_scales:
        if x.dim() != 2:
            raise ValueError("column-major scales are for 2-D activations")
        scales = torch.empty(num_groups, rows.shape[0], dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(rows.shape[0], num_groups, dtype=torch.float32, device=x.device)
    if rows.numel():
        per_program = min(next_power_of_2(num_groups), max(1, _VALUES_PER_PROGRAM // group_size))
        grid = (rows.shape[0], triton.cdiv(num_groups, per_program))
        for_tensor(_per_token_group_kernel, x)[grid](
            rows, q, scales, k, num_groups, rows.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
            GROUP=group_size, GROUPS=per_program, MIN_SCALED_AMAX=MIN_AMAX, MAX_FP8=FP8_MAX, num_warps=4,
        )  # fmt: skip
    if column_major_scales:
        return q.view(*x.shape), scales
    return q.view(*x.shape), scales.view(*x.shape[:-1], num_groups)


@triton.jit
def _per_token_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_q,
    BLOCK: tl.constexpr,
    MIN_SCALED_AMAX: tl.constexpr,
    MAX_FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
        peak = tl.maximum(peak, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(peak, 0), MIN_SCALED_AMAX), MAX_FP8)
    inverse = tl.math.div_rn(1.0, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + k0 + offs, to_fp8(x * inverse), mask=k0 + offs < K)
    tl.store(scale_ptr + row, scale)


@register_kernel(
    "quant", "per_token", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., K]` -> (fp8 `[..., K]`, fp32 scales `[..., 1]`); see `fp8.quantize_per_token`."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    if rows.numel():
        for_tensor(_per_token_kernel, x)[(rows.shape[0],)](
            rows, q, scales, k, rows.stride(0), q.stride(0),
            BLOCK=min(_VALUES_PER_PROGRAM, next_power_of_2(k)), MIN_SCALED_AMAX=MIN_AMAX, MAX_FP8=FP8_MAX,
            num_warps=4,
        )  # fmt: skip
    return q.view(*x.shape), scales.view(*x.shape[:-1], 1)
