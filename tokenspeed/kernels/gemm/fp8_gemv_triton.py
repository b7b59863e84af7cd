"""Triton FP8 weight-streaming GEMV (`gemm.fp8`, name "triton_gemv"): 1-16 tokens, fp8 weights, bf16 activations.

At decode sizes a projection is a stream of weight bytes, and fp8 halves
them; the activations are a few KB and stay in their dtype (no quantisation
step, no extra launch, and more accurate than the tensor-core GEMM). As in
`gemv_triton.py`, a program owns BLOCK_N whole output rows, streams them once
and writes finished outputs (no split-K, no second kernel). The weight is
widened fp8 -> fp32 (or the activation dtype for `tl.dot`) in registers.

With block scales a program's rows always lie in one row block (BLOCK_N
divides bn), so the scale of a K group is the same for all of its rows:
- one token (`USE_DOT` False): the K step is `GROUPS` groups of 128, loaded
  as a `[BLOCK_N, GROUPS, 128]` tile; the step's `GROUPS` scales multiply the
  `[1, GROUPS, 128]` input instead (128x fewer products), and the tile is
  FMA-accumulated in fp32 registers, reduced once at the end;
- 2-16 tokens (`USE_DOT`): `GROUPS` groups per step, dequantised in
  registers to the activation dtype exactly as the reference dequantises
  (w_fp8 * scale, rounded once), then `tl.dot(W, X^T)` with the weight rows
  as the M side (swap-AB, tokens padded to 16).
Per-channel and per-tensor scales (a block spanning K, `ROW_SCALE`) multiply
each row's finished sum instead (one token) or its dequantised rows (the dot).

Launched with programmatic dependent launch on Hopper (`kernels/pdl.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.attention.paged_tiles import dot
from tokenspeed.kernels.gemm import FP8_GEMV_MAX_TOKENS
from tokenspeed.kernels.gemm.fp8_reference import check_fp8_gemm_args
from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.quant.fp8 import GROUP_SIZE, WEIGHT_BLOCK, BlockSize
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2


@dataclass(frozen=True, slots=True)
class Fp8GemvConfig:
    """Launch shape of `_fp8_gemv_kernel`: `groups` K groups of 128 per step (one-token path)."""

    block_m: int
    block_n: int
    groups: int
    num_warps: int
    stages: int

    @property
    def use_dot(self) -> bool:
        return self.block_m > 1


def choose_config(m: int, k: int) -> Fp8GemvConfig:
    """Launch shape for `m` tokens and rows of `k` (the bf16 GEMV's measured shapes, at half the bytes).

    One token: 4 rows x up to 4096 values (16 KB) per program, loaded at once
    like the bf16 kernel's 2 x 4096; long rows (down_proj) take pipelined
    steps of 1024. More tokens: 16 rows x 512 values per tensor-core step,
    4 stages (two programs an SM even for 4096 rows). Not tuned one by one
    on the H200 yet: `benchmarks/fp8_kernels.py --sweep` times alternatives.
    """
    groups = triton.cdiv(k, GROUP_SIZE)
    if m == 1:
        if k > 8192:
            return Fp8GemvConfig(block_m=1, block_n=4, groups=8, num_warps=4, stages=3)
        return Fp8GemvConfig(
            block_m=1, block_n=4, groups=min(32, next_power_of_2(groups)), num_warps=8, stages=1
        )
    return Fp8GemvConfig(
        block_m=16, block_n=16, groups=min(4, next_power_of_2(groups)), num_warps=4, stages=4
    )


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_om,
    N: tl.constexpr,
    K: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see kernels/pdl.py: wait for the previous kernel before reading x
        gdc_wait()
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, GROUP_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_g = tl.arange(0, GROUPS)
    cols = offs_g[:, None] * GROUP_K + offs_c[None, :]  # [GROUPS, GROUP_K] offsets within a step
    rows = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn
    scale_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_BN) * stride_wsn  # the program's row block
    if ROW_SCALE:
        row_scales = tl.load(ws_ptr + (offs_n // SCALE_BN) * stride_wsn, mask=n_mask, other=0.0)
    if USE_DOT:  # 2-16 tokens: the step's weights dequantised as the reference rounds them, one dot
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        offs_kb = tl.arange(0, GROUPS * GROUP_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(0, K, GROUPS * GROUP_K, num_stages=STAGES):
            k_mask = (k0 + cols) < K
            w = tl.load(
                rows + (k0 + cols)[None, :, :], mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0
            ).to(tl.float32)
            if ROW_SCALE:
                w = w * row_scales[:, None, None]
            else:
                group_start = k0 + offs_g * GROUP_K
                w = (
                    w
                    * tl.load(scale_row + group_start // SCALE_BK, mask=group_start < K, other=0.0)[
                        None, :, None
                    ]
                )
            w = tl.reshape(w.to(x_ptr.dtype.element_ty), (BLOCK_N, GROUPS * GROUP_K))
            offs_k = k0 + offs_kb
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            acc += dot(w, tl.trans(x), IEEE)
    else:  # one token: [BLOCK_N, GROUPS, GROUP_K] tiles FMA-accumulated in fp32, one reduction at the end
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        tile = tl.zeros([BLOCK_N, GROUPS, GROUP_K], dtype=tl.float32)
        for k0 in tl.range(0, K, GROUPS * GROUP_K, num_stages=STAGES):
            k_mask = (k0 + cols) < K
            w = tl.load(
                rows + (k0 + cols)[None, :, :], mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0
            )
            x = tl.load(x_row + k0 + cols, mask=k_mask, other=0.0).to(tl.float32)
            if not ROW_SCALE:
                group_start = k0 + offs_g * GROUP_K
                x = x * tl.load(scale_row + group_start // SCALE_BK, mask=group_start < K, other=0.0)[:, None]
            tile += w.to(tl.float32) * x[None, :, :]
        acc = tl.sum(tl.sum(tile, 2), 1)[:, None]
        if ROW_SCALE:
            acc *= row_scales[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    dst = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def _fitting_block_n(block_n: int, scale_bn: int, row_scale: bool) -> int:
    """BLOCK_N, halved until a program's rows lie in one row block of block scales."""
    while not row_scale and scale_bn % block_n:
        block_n //= 2
    return block_n


@register_kernel(
    "gemm",
    "fp8",
    name="triton_gemv",
    band=Band.PERFORMANT,
    platforms=("cuda",),
    dtypes=FLOAT_DTYPES,
    workload={"num_tokens": (1, FP8_GEMV_MAX_TOKENS)},
)
def fp8_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_size: BlockSize = WEIGHT_BLOCK,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Fp8GemvConfig | None = None,
) -> torch.Tensor:
    """x `[..., K]` @ dequantised(weight)^T (+ bias) -> `[..., N]`; see `fp8_reference.fp8_gemm_reference`."""
    n, k = check_fp8_gemm_args(x, weight, weight_scale, block_size)
    if weight.stride(-1) != 1:
        raise ValueError("the weight must be contiguous along K")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or choose_config(m, k)
    row_scale = block_size[1] >= k
    block_n = _fitting_block_n(cfg.block_n, block_size[0], row_scale)
    if cfg.use_dot and block_n < 16:  # row blocks under 16 rows leave no MMA tile: one token per program
        cfg = choose_config(1, k)
        block_n = _fitting_block_n(cfg.block_n, block_size[0], row_scale)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, cfg.block_m))
    for_tensor(_fp8_gemv_kernel, x)[grid](
        x2, weight, weight_scale.contiguous(), bias if bias is not None else out, out, m,
        x2.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        N=n, K=k, SCALE_BN=block_size[0], SCALE_BK=block_size[1], ROW_SCALE=row_scale,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, GROUPS=cfg.groups, GROUP_K=GROUP_SIZE, STAGES=cfg.stages,
        USE_DOT=cfg.use_dot, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, **pdl_launch_options(pdl_enabled(x.device)),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
