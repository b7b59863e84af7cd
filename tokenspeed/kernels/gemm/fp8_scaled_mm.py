"""`gemm.fp8` on cuBLAS through `torch._scaled_mm` (name "scaled_mm", PERFORMANT, cuda, 2+ tokens).

The library's FP8 GEMMs ran at 1.9-2.3x the first Triton GEMM on the H200
(`fp8_kernels.py`, 2026-12-02: ~1190 against ~540 TFLOP/s at 4096 tokens),
so the formats cuBLAS takes on Hopper go to it:
- **block scales of 128 x 128** (DeepSeek-V3, Kimi-K2, Qwen3-FP8, and
  `quantization="fp8"`): activations quantised per token and group of 128
  (`quant.per_token_group`, the Triton GEMM's quantiser, its scales written
  column-major as cuBLAS wants them) against the weight's block scales:
  cuBLAS's 1 x 128 by 128 x 128 block scaling (CUDA 12.9+). The arithmetic
  is the Triton GEMM's (the same fp8 operands, each 128-deep partial
  product scaled in fp32), so the two agree to summation order;
- **per-channel or per-tensor scales** (a block spanning K): activations
  quantised per token (`quant.per_token`), then rowwise x rowwise scaling.
Registered for bf16 activations and used for bf16 outputs. Other layouts
(row blocks narrower than 128, as fused projections with unaligned parts
produce; dimensions not multiples of 128 / 16; block-scaled K not a multiple
of 512, whose scales cuBLAS reads with a leading dimension rounded up to 4
blocks; fp32 logits) run the Triton GEMM. Token counts that are not a
multiple of 4 are padded to one (cuBLAS refuses a column-major activation
scale tensor whose leading dimension is not; H200, 2026-12-03). The Triton
GEMM also serves a format this torch build or device refuses or
computes differently: each format is tried once per device on a small
product checked against the reference (`probe_cublas`: a different scale
per row, K group and weight block, so a misread scale layout fails),
outside any CUDA graph capture and with torch's sync debug mode lifted (the
engine's capture probe sets it to raise); a failure is logged and
remembered (inside a capture an untried format runs the Triton GEMM). So
selection stays honest: this kernel is cuBLAS wherever cuBLAS serves
correctly, and says so in `cublas_formats()`.
"""

from __future__ import annotations

import logging

import torch

from tokenspeed.kernels.autotune import synchronisation_allowed
from tokenspeed.kernels.gemm.fp8_gemm_triton import fp8_gemm_triton
from tokenspeed.kernels.gemm.fp8_reference import check_fp8_gemm_args, fp8_gemm_reference
from tokenspeed.kernels.quant.fp8 import (
    PER_CHANNEL_BLOCK,
    WEIGHT_BLOCK,
    BlockSize,
    dequantize_per_token_group,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_block,
    scales_whole_rows,
)
from tokenspeed.kernels.quant.quantize_triton import (
    quantize_per_token_group_triton,
    quantize_per_token_triton,
)
from tokenspeed.kernels.registry import Band, register_kernel

logger = logging.getLogger("tokenspeed.kernels")

MAX_TOKENS = 2**31 - 1
BLOCKWISE, ROWWISE = "blockwise_1x128_128x128", "rowwise"
# (device index, format) -> whether cuBLAS took it
_SUPPORTED: dict[tuple[int, str], bool] = {}


def cublas_format(n: int, k: int, block_size: BlockSize, out_dtype: torch.dtype) -> str | None:
    """The cuBLAS scaling that serves this weight layout with bf16 output, or None (the Triton GEMM serves it)."""
    if out_dtype != torch.bfloat16 or n % 16 or k % 16:
        return None
    if scales_whole_rows(block_size, k):
        return ROWWISE
    if tuple(block_size) == WEIGHT_BLOCK and n % 128 == 0 and k % 512 == 0:
        return BLOCKWISE  # cuBLAS reads the weight scales with a leading dimension rounded up to 4 K blocks
    return None


def cublas_fp8_gemm(
    x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, fmt: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """bf16 `[M, N]`; `weight_scale` fp32 contiguous in the checkpoint layout (`quant/fp8.py`)."""
    n, m = weight.shape[0], x2.shape[0]
    pad = -m % 4 if fmt == BLOCKWISE else 0
    if pad:  # cuBLAS refuses column-major activation scales whose leading dimension (M) is not a multiple of 4
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
    if fmt == BLOCKWISE:
        a, a_scale = quantize_per_token_group_triton(x2, column_major_scales=True)
        b_scale = weight_scale.t()  # [K/128, N/128], whose transpose is row-major: cuBLAS's 128 x 128 layout
    else:
        a, a_scale = quantize_per_token_triton(x2)
        b_scale = _per_row(weight_scale, n).view(1, n)
    bias = None if bias is None else bias.to(torch.bfloat16)
    out = torch._scaled_mm(a, weight.t(), a_scale, b_scale, bias=bias, out_dtype=torch.bfloat16)
    return out[:m] if pad else out


def _per_row(weight_scale: torch.Tensor, n: int) -> torch.Tensor:
    """Scales of a block spanning K (`[ceil(N / bn), 1]`) as one per output row, contiguous `[N]`."""
    if weight_scale.shape[0] == n:
        return weight_scale.view(n)
    bn = -(-n // weight_scale.shape[0])
    return weight_scale.view(-1).repeat_interleave(bn)[:n].contiguous()


def probe_cublas(fmt: str, device: torch.device) -> bool:
    """Whether `torch._scaled_mm` computes `fmt` right here: a 17 x 512 x 256 product against the reference.

    Every row of x, K group and weight block has its own scale, so a scale
    layout cuBLAS reads differently from ours fails (relative error > 1e-2).
    """
    block_size = WEIGHT_BLOCK if fmt == BLOCKWISE else PER_CHANNEL_BLOCK
    rows = torch.arange(1, 18, device=device, dtype=torch.float32)[:, None]
    x = (rows * torch.linspace(0.5, 2.0, 512, device=device)).to(torch.bfloat16)
    w8, scale = quantize_weight_block(torch.linspace(-1.0, 1.0, 256 * 512, device=device).view(256, 512), block_size)
    if fmt == BLOCKWISE:
        x_seen = dequantize_per_token_group(*quantize_per_token_group(x))
    else:
        x_q, x_scale = quantize_per_token(x)
        x_seen = x_q.float() * x_scale
    want = fp8_gemm_reference(x_seen, w8, scale, block_size=block_size)
    try:
        with synchronisation_allowed():  # the capture probe runs with sync debug mode raising
            got = cublas_fp8_gemm(x, w8, scale, fmt, None).float()
            ok = bool(((got - want).norm() <= 1e-2 * want.norm()).item())
    except RuntimeError as exc:
        logger.warning("torch._scaled_mm refuses %s scaling here (%s); the Triton FP8 GEMM serves it", fmt, exc)
        return False
    if not ok:
        logger.warning("torch._scaled_mm computes %s scaling differently here; the Triton FP8 GEMM serves it", fmt)
    return ok


def _cublas_takes(fmt: str, device: torch.device) -> bool:
    """`probe_cublas`, once per device and format, never inside a CUDA graph capture."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), fmt)
    known = _SUPPORTED.get(key)
    if known is not None:
        return known
    if torch.cuda.is_current_stream_capturing():
        return False  # untried: never try inside a capture (the eager warm-up tries it)
    _SUPPORTED[key] = probe_cublas(fmt, device)
    return _SUPPORTED[key]


def cublas_formats() -> dict[tuple[int, str], bool]:
    """What each device's cuBLAS took so far (for benchmarks and tests)."""
    return dict(_SUPPORTED)


@register_kernel(
    "gemm",
    "fp8",
    name="scaled_mm",
    band=Band.PERFORMANT,
    platforms=("cuda",),
    dtypes=(torch.bfloat16,),
    workload={"num_tokens": (2, MAX_TOKENS)},  # also 2-16 tokens, where the GEMV's skinny path is switched off
)
def fp8_scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_size: BlockSize = WEIGHT_BLOCK,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x `[..., K]` @ dequantised(weight)^T (+ bias), activations quantised; see the module docstring."""
    n, k = check_fp8_gemm_args(x, weight, weight_scale, block_size)
    out_dtype = out_dtype or x.dtype
    fmt = cublas_format(n, k, block_size, out_dtype)
    if fmt is None or weight.stride(-1) != 1 or not _cublas_takes(fmt, x.device):
        return fp8_gemm_triton(x, weight, weight_scale, block_size=block_size, bias=bias, out_dtype=out_dtype)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return torch.empty(*x.shape[:-1], n, dtype=out_dtype, device=x.device)
    return cublas_fp8_gemm(x2, weight, weight_scale.contiguous(), fmt, bias).view(*x.shape[:-1], n)
