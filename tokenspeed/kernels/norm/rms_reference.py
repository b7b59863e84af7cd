"""Reference RMSNorm, with the residual add fused in the same call.

The fused form exists because every decoder layer does "add the sub-layer's
output to the residual stream, then normalise": fast kernels do both in one
pass, and with tensor parallelism the all-reduce joins them too. The reference
keeps Hugging Face's order of operations (normalise in fp32, cast back, then
scale by the weight) so it matches HF checkpoints to the last bit in fp32.
"""

from __future__ import annotations

from typing import overload

import torch

from tokenspeed.kernels.registry import Band, register_kernel


@overload
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None
) -> torch.Tensor: ...


@overload
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


@register_kernel("norm", "rms", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis. With `residual`: returns (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    summed = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * h.to(x.dtype)
    if residual is None:
        return normed
    return normed, summed
