"""Gated MLP (SwiGLU): down(silu(gate(x)) * up(x)) with gate and up fused into one GEMM.

At decode sizes the activation is fused too: `gemm.decode_silu_mul` streams
the gate/up weight once and writes silu(gate) * up directly, so the
`[tokens, 2 * intermediate]` product and the separate activation kernel
disappear. Chosen at build time like every kernel (`--kernel
gemm.decode_silu_mul=reference` turns it off); per call one comparison.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed.kernels.registry import platform_of, select_kernel
from tokenspeed.layers.linear import GateUpLinear, Linear, select_decode_gemm
from tokenspeed.layers.norm import RMSNorm


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
        self._fused_gate_up, self._fused_max_tokens = select_decode_gemm(
            "decode_silu_mul", device=device, dtype=dtype
        )

    @property
    def decode_max_tokens(self) -> int:
        """Most tokens `forward_decode` serves (-1 when a decode kernel is missing)."""
        return min(self._fused_max_tokens, self.down_proj.decode_max_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self._fused_max_tokens:
            return self.down_proj(self._gate_up_act(x))
        return self.down_proj(self._act(self.gate_up_proj(x)))

    def _gate_up_act(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """silu_and_mul(gate_up([norm](x))) in one kernel (fp8 weights: the FP8 GEMV's fused form)."""
        gate_up = self.gate_up_proj
        norm_weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        if gate_up.fp8_block is not None:
            return gate_up.fp8_decode(x, norm_weight=norm_weight, eps=eps, silu_mul=True)
        return self._fused_gate_up(x, gate_up.weight, gate_up.bias, norm_weight=norm_weight, eps=eps)  # type: ignore[misc]

    def forward_decode(self, x: torch.Tensor, *, norm: RMSNorm, residual: torch.Tensor) -> torch.Tensor:
        """residual + down(silu_and_mul(gate_up(norm(x)))) in two kernels; for `decode_max_tokens` rows at most.

        The decoder layer's post-attention norm runs in the gate/up kernel's
        prologue and the residual add in the down kernel's epilogue, so the
        result is the residual stream itself.
        """
        if self._fused_gate_up is None:
            raise RuntimeError("no fused gate/up decode kernel was selected for this MLP")
        return self.down_proj.forward_decode(self._gate_up_act(x, norm), residual=residual)
