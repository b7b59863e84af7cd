"""Gated MLP (SwiGLU): down(silu(gate(x)) * up(x)) with gate and up fused into one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed.kernels.registry import platform_of, select_kernel
from tokenspeed.layers.linear import GateUpLinear, Linear


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(
            hidden_size, intermediate_size, bias=bias, dtype=dtype, device=device
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype, device=device)
        self._act = select_kernel(
            "activation", "silu_and_mul", platform=platform_of(device), dtype=dtype
        ).impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(self.gate_up_proj(x)))
