"""Per-batch choice between the small-batch and large-batch `moe.experts` kernels.

Layers select kernels once, at construction, but the fastest MoE kernel
depends on the batch's token count (see `experts_grouped_mm.GROUPED_MM_MIN_TOKENS`),
which changes every step. `select_experts_by_batch` therefore resolves the
registry twice, for the two sides of the crossover (so overrides, dtypes and
availability are honoured exactly as by `select_kernel`), and the returned
callable picks between them by `hidden.shape[0]`, a host-side int: no sync,
and a CUDA graph captured at one batch size always replays the same kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed.kernels.moe.experts_grouped_mm import GROUPED_MM_MIN_TOKENS, MAX_TOKENS
from tokenspeed.kernels.registry import KernelSpec, select_kernel


@dataclass(frozen=True, slots=True)
class ExpertsByBatch:
    """`moe.experts` with the kernel chosen by token count; same signature as the kernels."""

    small: KernelSpec  # batches of fewer than `min_large_tokens` tokens
    large: KernelSpec
    min_large_tokens: int

    def kernel_for(self, num_tokens: int) -> KernelSpec:
        return self.large if num_tokens >= self.min_large_tokens else self.small

    def __call__(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return self.kernel_for(hidden.shape[0])(hidden, w13, w2, topk_weights, topk_ids)


def select_experts_by_batch(*, platform: str, dtype: torch.dtype) -> ExpertsByBatch:
    """Resolve `moe.experts` below and from the crossover; raises KernelSelectionError like `select_kernel`."""
    small = select_kernel(
        "moe",
        "experts",
        platform=platform,
        dtype=dtype,
        workload={"num_tokens": (1, GROUPED_MM_MIN_TOKENS - 1)},
    )
    large = select_kernel(
        "moe",
        "experts",
        platform=platform,
        dtype=dtype,
        workload={"num_tokens": (GROUPED_MM_MIN_TOKENS, MAX_TOKENS)},
    )
    return ExpertsByBatch(small=small, large=large, min_large_tokens=GROUPED_MM_MIN_TOKENS)
