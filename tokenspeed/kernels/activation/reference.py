"""Reference gated SiLU (SwiGLU): the activation of every dense MLP in Llama/Qwen/Mistral.

Input is the fused gate/up projection `[..., 2 * d]` with the gate half first,
so the MLP needs one GEMM for both and fast kernels can fuse the activation
into that GEMM's epilogue.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenspeed.kernels.registry import Band, register_kernel


@register_kernel(
    "activation", "silu_and_mul", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda")
)
def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
