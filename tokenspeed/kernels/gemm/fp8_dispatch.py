"""Per-batch choice between the FP8 GEMV (1-16 tokens) and the FP8 tensor-core GEMMs (`gemm.fp8`).

A layer selects its kernels once, at construction, but which FP8 kernel is
fastest depends on the step's token count. `select_fp8_gemm_by_batch`
therefore resolves `gemm.fp8` for both sides of `FP8_GEMV_MAX_TOKENS` (so
overrides such as `--kernel gemm.fp8=reference`, dtypes and availability are
honoured exactly as by `select_kernel`), and the returned callable picks by
the input's token count, a host-side int: no sync, and a CUDA graph captured
at one batch size always replays the same kernel. On a CUDA device with bf16
activations that is the Triton GEMV up to 16 tokens and cuBLAS (`scaled_mm`,
which hands the layouts it cannot take to the Triton GEMM) above; on the
CPU both sides are the reference. `TOKENSPEED_FP8_SKINNY=0` keeps the GEMV
side at one token (`gemv_max_tokens`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed.kernels.gemm import FP8_GEMV_MAX_TOKENS
from tokenspeed.kernels.quant.fp8 import WEIGHT_BLOCK, BlockSize, scales_whole_rows
from tokenspeed.kernels.registry import KernelSpec, select_kernel

MAX_TOKENS = 2**31 - 1
# The small-batch kernel that also has the decode layer's fused forms (norm prologue, SiLU-and-mul, residual).
FUSED_DECODE_KERNEL = "triton_gemv"


def fits_silu_mul(rows: int, k: int, block_size: BlockSize) -> bool:
    """Whether a `[rows, k]` weight splits into gate and up halves whose row blocks never mix
    (a fused GEMV program reads one scale row for its gate rows and one for its up rows)."""
    return rows % 2 == 0 and (scales_whole_rows(block_size, k) or (rows // 2) % block_size[0] == 0)


@dataclass(frozen=True, slots=True)
class Fp8GemmByBatch:
    """`gemm.fp8` with the kernel chosen by token count; same signature as the kernels."""

    small: KernelSpec  # up to `max_small_tokens` tokens
    large: KernelSpec
    max_small_tokens: int

    @property
    def fused_decode(self) -> Callable[..., torch.Tensor] | None:
        """The small-batch kernel when it takes the fused decode forms (`fp8_gemv_triton`), else None."""
        return self.small.impl if self.small.name == FUSED_DECODE_KERNEL else None

    def kernel_for(self, num_tokens: int) -> KernelSpec:
        """The kernel a step of `num_tokens` rows runs."""
        return self.small if num_tokens <= self.max_small_tokens else self.large

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        *,
        block_size: BlockSize = WEIGHT_BLOCK,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        kernel = self.kernel_for(x.numel() // max(x.shape[-1], 1))
        return kernel(x, weight, weight_scale, block_size=block_size, bias=bias, out_dtype=out_dtype)


def gemv_max_tokens() -> int:
    """Tokens the GEMV side serves: `FP8_GEMV_MAX_TOKENS`, or 1 with `TOKENSPEED_FP8_SKINNY=0` (the skinny
    GEMM's off switch: 2-16 tokens then take the FP8 GEMMs, as before it existed)."""
    return 1 if os.environ.get("TOKENSPEED_FP8_SKINNY", "1") == "0" else FP8_GEMV_MAX_TOKENS


def select_fp8_gemm_by_batch(*, platform: str, dtype: torch.dtype) -> Fp8GemmByBatch:
    """Resolve `gemm.fp8` up to and above the GEMV's range; raises KernelSelectionError like `select_kernel`."""
    small_max = gemv_max_tokens()
    small = select_kernel("gemm", "fp8", platform=platform, dtype=dtype, workload={"num_tokens": (1, small_max)})
    large = select_kernel(
        "gemm", "fp8", platform=platform, dtype=dtype, workload={"num_tokens": (small_max + 1, MAX_TOKENS)}
    )
    return Fp8GemmByBatch(small=small, large=large, max_small_tokens=small_max)
