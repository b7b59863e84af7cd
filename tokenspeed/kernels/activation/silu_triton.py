"""Triton gated SiLU: out = silu(gate) * up over the fused gate/up projection `[..., 2 * d]`.

One read of each half and one write of the product; the silu is rounded to the
activation dtype before the multiply, as the torch reference does, so bf16
results agree with it bit for bit in the common case.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor

_BLOCK = 1024


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in `dtype` from fp32 `gate` and `up` (each holding a `dtype` value), the silu rounded to
    `dtype` before the multiply: this kernel's arithmetic, which the FP8 GEMV's fused epilogue
    (`gemm/fp8_gemv_triton.py`) shares so that fused and unfused give the same bits."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    if USE_PDL:  # wait for the previous kernel before any access; never triggers (kernels/pdl.py)
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, silu_mul_rounded(gate, up, out_ptr.dtype.element_ty), mask=mask)


@register_kernel(
    "activation", "silu_and_mul", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows and d:
        block = min(_BLOCK, triton.next_power_of_2(d))
        for_tensor(_silu_and_mul_kernel, x)[(rows, triton.cdiv(d, block))](
            x2, out, x2.stride(0), D=d, BLOCK=block, num_warps=4,
            **pdl_launch_options(pdl_enabled(x.device)),
        )
    return out
