"""Reference FP8 linear (`gemm.fp8`): dequantise the weight on the fly, then an ordinary GEMM.

Signature (the contract of every `gemm.fp8` kernel)::

    fp8_gemm(x [..., K], weight fp8 [N, K], weight_scale fp32 [ceil(N/bn), ceil(K/bk)], *,
             block_size=(bn, bk), bias=None, out_dtype=None) -> [..., N] in out_dtype (default x's)

y = x (w_fp8 * scale[n // bn, k // bk])^T (+ bias): block scales as the
checkpoints publish them ((128, 128)), per output channel ((1, K), scale
`[N, 1]`) or per tensor ((N, K)). This is the oracle and the CPU path:
with fp32 activations it is exactly transformers on the dequantised weights.

Numerics of the fast kernels against it: the tensor-core GEMM quantises the
activations too (dynamic, per token and group of 128: `quant/fp8.py`), which
this reference reproduces with `quantize_activations=True` (tests only; the
error of that step is ~2^-5 of each value, and is the price of fp8 x fp8
tensor cores); the weight-streaming GEMV keeps the activations as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenspeed.kernels.quant.fp8 import (
    GROUP_SIZE,
    WEIGHT_BLOCK,
    BlockSize,
    check_weight_scale,
    dequantize_per_token_group,
    dequantize_weight,
    quantize_per_token_group,
)
from tokenspeed.kernels.registry import Band, register_kernel


def check_fp8_gemm_args(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_size: BlockSize
) -> tuple[int, int]:
    """(N, K) after checking the weight, its scales and x agree (ValueError otherwise).

    The Triton kernels apply weight scales per 128-wide K step, so a scale
    block must span whole steps (bk a multiple of 128) unless one spans all of K.
    """
    check_weight_scale(weight, weight_scale, block_size)
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if block_size[1] % GROUP_SIZE and block_size[1] < k:
        raise ValueError(f"block_size[1]={block_size[1]} must be a multiple of {GROUP_SIZE} or span K={k}")
    return n, k


@register_kernel("gemm", "fp8", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def fp8_gemm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_size: BlockSize = WEIGHT_BLOCK,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """x @ dequantised(weight)^T (+ bias); `quantize_activations` mimics the tensor-core GEMM (tests)."""
    check_fp8_gemm_args(x, weight, weight_scale, block_size)
    if quantize_activations:
        x = dequantize_per_token_group(*quantize_per_token_group(x), dtype=x.dtype)
    y = F.linear(x, dequantize_weight(weight, weight_scale, block_size, x.dtype), bias)
    return y if out_dtype is None else y.to(out_dtype)
