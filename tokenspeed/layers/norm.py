"""RMSNorm layer; the residual add is fused into the norm (see `kernels/norm/rms_reference.py`)."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from tokenspeed.kernels.registry import platform_of, select_kernel


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self._kernel = select_kernel("norm", "rms", platform=platform_of(device), dtype=dtype).impl

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual)."""
        return self._kernel(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
