"""Triton RMSNorm with the residual add fused in: one read of x (and residual), one write of each output.

Numerics follow the reference (and Hugging Face) step by step: the sum
x + residual is rounded to the activation dtype (that rounded value is the new
residual stream), the mean of squares is taken in fp32, the normalised value is
rounded to the activation dtype and only then multiplied by the weight. Rows
may be strided (per-head q/k norm runs on views of the fused QKV output): a row
index r addresses `(r // inner) * stride_outer + (r % inner) * stride_inner`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2

_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    eps,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    INNER: tl.constexpr,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a parameter: read before the wait
    if USE_PDL:  # wait before touching x, residual or the outputs; never triggers (kernels/pdl.py)
        gdc_wait()
    x_row = x_ptr + (r // INNER) * stride_x_outer + (r % INNER) * stride_x_inner
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_row = residual_ptr + (r // INNER) * stride_r_outer + (r % INNER) * stride_r_inner
        res = tl.load(res_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(summed_ptr + r * N + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r * N + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, inner, stride_outer, stride_inner) describing x's rows without copying when possible."""
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, 0, 0
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    return x, x.shape[1], x.stride(0), x.stride(1)


@register_kernel("norm", "rms", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES)
def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis. With `residual`: returns (norm(x + residual), x + residual)."""
    n = x.shape[-1]
    if n > _MAX_HIDDEN:
        raise ValueError(f"rms_norm_triton handles rows up to {_MAX_HIDDEN} wide, got {n}")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    rows = x.numel() // n if n else 0
    if rows:
        xv, inner, sxo, sxi = _rows(x)
        if residual is not None:
            if residual.shape != x.shape:
                raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
            rv, _, sro, sri = _rows(residual)
        else:
            rv, sro, sri = xv, 0, 0
        block = next_power_of_2(n)
        for_tensor(_rms_norm_kernel, x)[(rows,)](
            xv,
            rv,
            weight,
            out,
            summed,
            eps,
            sxo,
            sxi,
            sro,
            sri,
            INNER=inner,
            N=n,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
            **pdl_launch_options(pdl_enabled(x.device)),
        )
    return out if residual is None else (out, summed)
