"""Reference decode GEMMs: the oracle of the Triton GEMV kernels and their off switch.

`gemm.decode` is y = x W^T (+ b), rounded to the activation dtype and then
cast to `out_dtype` (the LM head asks for fp32 logits: the rounding keeps them
bit-compatible with `F.linear(...).float()`). `gemm.decode_silu_mul` is the
gate/up projection of a gated MLP with the activation fused in:
silu(x Wg^T) * (x Wu^T) where W is `[2 * d, in]`, gate rows first, exactly the
unfused `silu_and_mul(F.linear(x, W))`. Both take an optional RMSNorm prologue
(`norm_weight`, `eps`: the input is normalised first) and `gemm.decode` an
optional residual epilogue (`residual` is added to the rounded product): at
decode sizes a decoder layer then needs no separate norm kernels. Layers use
a fast path only when the registry picks a kernel above the REFERENCE band, so
forcing `=reference` (`--kernel gemm.decode=reference`) restores the plain
`F.linear` path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenspeed.kernels.activation.reference import silu_and_mul_reference
from tokenspeed.kernels.norm.rms_reference import rms_norm_reference
from tokenspeed.kernels.registry import Band, register_kernel


def _maybe_norm(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x if norm_weight is None else rms_norm_reference(x, norm_weight, eps)


@register_kernel("gemm", "decode", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def gemv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """[rms_norm(x)] @ weight^T (+ bias) [+ residual] -> `[tokens, out]` in `out_dtype` (default x's)."""
    y = F.linear(_maybe_norm(x, norm_weight, eps), weight, bias)
    if residual is not None:
        y = y + residual
    return y if out_dtype is None else y.to(out_dtype)


@register_kernel(
    "gemm", "decode_silu_mul", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda")
)
def gemv_silu_mul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """silu(x' Wg^T + bg) * (x' Wu^T + bu), x' = rms_norm(x) when `norm_weight` is given."""
    return silu_and_mul_reference(F.linear(_maybe_norm(x, norm_weight, eps), weight, bias))
