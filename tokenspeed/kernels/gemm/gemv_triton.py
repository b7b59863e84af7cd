"""Triton GEMV / skinny GEMM for decode: a few tokens against a whole weight matrix, in one pass.

At decode batch sizes a projection reads each weight byte once and does
almost no arithmetic per byte, so its floor is weight bytes over memory
bandwidth. cuBLAS splits K for the narrow projections (o_proj, down_proj) and
adds a reduction kernel. This kernel instead gives every program a slab of
BLOCK_N whole output rows: it streams those rows once with 16-byte loads,
reduces them in registers and writes finished outputs (no partial sums, no
second kernel); small slabs make thousands of short programs, which keeps
every SM's memory queue full and the tail short.

Two inner loops, chosen per shape (constexpr `USE_DOT`):
- one token (`BLOCK_M == 1`): multiply-add into a `[BLOCK_N, BLOCK_K]` fp32
  register tile, the next tile already requested, one reduction at the end;
- 2-16 tokens: `tl.dot(W_tile, X_tile^T)` with the weight rows as the M side
  (swap-AB), the tokens padded to 16 as the N side.

Fused, each one kernel fewer per decoder layer: an RMSNorm prologue
(`HAS_NORM`: each program recomputes the rows' RMS from the K inputs, 8 KB
from L2, instead of a norm kernel writing them out), a residual epilogue
(`HAS_RESIDUAL`), bias, SiLU-and-mul (`SILU_MUL`: a program owns gate rows n
and up rows n + N of a `[2N, K]` weight and writes silu(g) * u, so the
`[tokens, 2N]` intermediate never exists) and fp32 output (the LM head).
Numerics follow the unfused path step by step: the normalised input is
rounded as `rms_norm_reference` rounds it, the accumulator is rounded to the
activation dtype (what `F.linear` returns) before the activation, the
residual add or the fp32 cast.

On Hopper the kernel is launched with programmatic dependent launch: it asks
for its first weight tile before it waits for the previous kernel, then lets
the next kernel launch, so consecutive GEMVs overlap one's tail with the
next one's first loads (`kernels/pdl.py`; `TOKENSPEED_PDL=0` turns it off).
Fixed grids per shape: launches capture in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.gemm import DECODE_MAX_TOKENS
from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch shape of `_gemv_kernel` (see `choose_config`)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    stages: int

    @property
    def use_dot(self) -> bool:
        return self.block_m > 1


@triton.jit
def load_rows(rows, offs_k, n_mask, K: tl.constexpr, EVEN: tl.constexpr):
    """`[BLOCK_N, BLOCK_K]` of weight rows at columns `offs_k` (masked unless the shape is even)."""
    if EVEN:
        tile = tl.load(rows + offs_k[None, :])
    else:
        tile = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    return tile


@triton.jit
def _load_x(x_rows, offs_k, m_mask, norm_w_ptr, rstd, K: tl.constexpr, HAS_NORM: tl.constexpr):
    """`[BLOCK_M, BLOCK_K]` of the input, RMS-normalised as `rms_norm_reference` rounds it when HAS_NORM."""
    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    if HAS_NORM:
        nw = tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
        x = (nw[None, :] * normed).to(x.dtype)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_w_ptr,
    res_ptr,
    out_ptr,
    M,
    eps,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_kb = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    even: tl.constexpr = EVEN_N and EVEN_K
    gate_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    # The first weight tile is requested before the norm's pass over x, so that latency overlaps.
    w_cur = load_rows(gate_rows, offs_kb, n_mask, K, even)
    u_cur = w_cur
    if SILU_MUL:
        u_cur = load_rows(up_rows, offs_kb, n_mask, K, even)
    if USE_PDL:
        # Programmatic dependent launch: wait for the previous kernel only now, before the first read
        # of its output (x, residual) and any write of ours; then let the next kernel's programs take
        # SMs as ours retire (they request their own first weight tiles meanwhile).
        gdc_wait()
        gdc_launch_dependents()
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:  # each program recomputes the rows' RMS: K values from L2, cheaper than a kernel
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in tl.static_range(0, K, NORM_BLOCK):
            offs = k0 + tl.arange(0, NORM_BLOCK)
            xv = tl.load(x_rows + offs[None, :], mask=m_mask[:, None] & (offs[None, :] < K), other=0.0)
            squares += tl.sum(xv.to(tl.float32) * xv.to(tl.float32), 1)
        rstd = tl.rsqrt(squares / K + eps)

    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + offs_kb
            xt = tl.trans(_load_x(x_rows, offs_k, m_mask, norm_w_ptr, rstd, K, HAS_NORM))
            w = load_rows(gate_rows, offs_k, n_mask, K, even)
            if IEEE:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
            if SILU_MUL:
                u = load_rows(up_rows, offs_k, n_mask, K, even)
                if IEEE:
                    acc_up = tl.dot(u, xt, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(u, xt, acc_up)
    else:  # one token: FMA into a register tile, one reduction at the end; next tile prefetched
        tile = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        tile_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + offs_kb
            nxt = offs_k + BLOCK_K
            w_nxt = tl.load(gate_rows + nxt[None, :], mask=n_mask[:, None] & (nxt[None, :] < K), other=0.0)
            x = _load_x(x_rows, offs_k, m_mask, norm_w_ptr, rstd, K, HAS_NORM).to(tl.float32)
            tile += w_cur.to(tl.float32) * x
            w_cur = w_nxt
            if SILU_MUL:
                u_nxt = tl.load(up_rows + nxt[None, :], mask=n_mask[:, None] & (nxt[None, :] < K), other=0.0)
                tile_up += u_cur.to(tl.float32) * x
                u_cur = u_nxt
        acc = tl.sum(tile, 1)[:, None]
        acc_up = tl.sum(tile_up, 1)[:, None]

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    # Round to the activation dtype first, as the unfused path's F.linear output is.
    y = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    if SILU_MUL:
        up = acc_up.to(x_ptr.dtype.element_ty).to(tl.float32)
        act = (y / (1.0 + tl.exp(-y))).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    out_mask = n_mask[:, None] & m_mask[None, :]
    if HAS_RESIDUAL:  # the residual stream: round(round(x W^T) + residual), as the fused add+norm does
        res = tl.load(res_ptr + offs_m.to(tl.int64)[None, :] * stride_rm + offs_n[:, None], mask=out_mask, other=0.0)
        y = y + res.to(tl.float32)
    dst = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=out_mask)


def choose_config(m: int, n: int, k: int, *, silu_mul: bool = False) -> GemvConfig:
    """Launch shape for `m` tokens against `n` output rows of length `k` (measured on an H200).

    One token, from benchmarks/gemv_bench.py's sweep at the 8B shapes with the
    fused epilogues and PDL (us; cuBLAS plain / this config / the runner-up):
    qkv 15.4 / 14.2 (2 rows x 4096) / 14.5; o_proj 12.9 / 8.8 (4 x 2048, 8
    warps) / 9.6; gate_up+silu 56.1 / 54.6 (2 + 2 rows x 4096) / 55.0; down
    31.1 / 29.7 (4 x 512, 3 cp.async stages) / 30.8; lm_head 241.9 / 232.1
    (2 x 4096) / 230.6. A whole 4096-long row per step issues all of a
    program's loads at once; small slabs keep programs short, so the tail of
    these 9-60 us kernels stays short. The long K of down_proj wants the
    pipelined loop instead. More tokens: the tensor-core path, tokens padded
    to 16 (served by cuBLAS in the engine: see `kernels/gemm/__init__.py`).
    """
    if m == 1:
        if k > 8192:
            return GemvConfig(block_m=1, block_n=4, block_k=512, num_warps=4, stages=3)
        if n <= 4096 and not silu_mul:
            return GemvConfig(block_m=1, block_n=4, block_k=2048, num_warps=8, stages=1)
        return GemvConfig(block_m=1, block_n=2, block_k=4096, num_warps=4, stages=1)
    return GemvConfig(block_m=16, block_n=32, block_k=256, num_warps=4, stages=4)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    n: int,
    *,
    bias: torch.Tensor | None,
    silu_mul: bool,
    norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    config: GemvConfig | None,
) -> torch.Tensor:
    m, k = x.shape
    if m == 0 or n == 0:
        return out
    if weight.stride(-1) != 1:
        raise ValueError("the weight must be contiguous along its input dimension")
    if residual is not None and (residual.shape != out.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must be a row-major {tuple(out.shape)}, got {tuple(residual.shape)}")
    cfg = config or choose_config(m, n, k, silu_mul=silu_mul)
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    norm_block = min(max(16, 4096 // cfg.block_m), triton.next_power_of_2(k))
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    for_tensor(_gemv_kernel, x)[grid](
        x,
        weight,
        bias if bias is not None else weight,
        norm_weight if norm_weight is not None else weight,
        residual if residual is not None else out,
        out,
        m,
        eps,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        N=n,
        K=k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        NORM_BLOCK=norm_block,
        STAGES=cfg.stages,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % block_k == 0,
        USE_DOT=cfg.use_dot,
        SILU_MUL=silu_mul,
        HAS_BIAS=bias is not None,
        HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps,
        **pdl_launch_options(pdl_enabled(x.device)),
    )
    return out


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@register_kernel(
    "gemm",
    "decode",
    name="triton",
    band=Band.PORTABLE,
    platforms=("cuda",),
    dtypes=FLOAT_DTYPES,
    workload={"num_tokens": (1, DECODE_MAX_TOKENS)},
)
def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """[rms_norm(x)] @ weight^T (+ bias) [+ residual] -> `[tokens, out]` in `out_dtype` (default x's).

    x `[tokens, in]`; weight `[out, in]`; `norm_weight` `[in]` applies RMSNorm
    (eps) to x first; `residual` `[tokens, out]` is added to the rounded product.
    """
    x2 = _as_rows(x)
    n = weight.shape[0]
    out = torch.empty(x2.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    _launch(x2, weight, out, n, bias=bias, silu_mul=False, norm_weight=norm_weight, eps=eps,
            residual=residual, config=config)
    return out.reshape(*x.shape[:-1], n)


@register_kernel(
    "gemm",
    "decode_silu_mul",
    name="triton",
    band=Band.PORTABLE,
    platforms=("cuda",),
    dtypes=FLOAT_DTYPES,
    workload={"num_tokens": (1, DECODE_MAX_TOKENS)},
)
def gemv_silu_mul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """silu(x' Wg^T + bg) * (x' Wu^T + bu), x' = rms_norm(x) when `norm_weight` is given -> `[tokens, d]`.

    weight `[2 * d, in]`: gate rows, then up rows.
    """
    x2 = _as_rows(x)
    d = weight.shape[0] // 2
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    _launch(x2, weight, out, d, bias=bias, silu_mul=True, norm_weight=norm_weight, eps=eps,
            residual=None, config=config)
    return out.reshape(*x.shape[:-1], d)
