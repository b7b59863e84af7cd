"""Rotary embedding layer: one cos/sin table per model, indexed by token position.

The table is built once at construction (fp32, with YaRN's attention factor
folded in) so every step only gathers rows; a model shares one instance
across its layers. Positions beyond `max_positions` are the caller's error
(the engine rejects over-long contexts before they reach the model).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed.kernels.registry import platform_of, select_kernel
from tokenspeed.layers.rope_scaling import RopeConfig, compute_inv_freq, rotary_dim_of


def build_cos_sin(
    inv_freq: torch.Tensor, attention_factor: float, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables `[max_positions, len(inv_freq)]` in fp32."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq.float())
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        rope: RopeConfig,
        *,
        head_dim: int,
        max_position_embeddings: int,
        max_positions: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(rope, head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even and within head_dim {head_dim}")
        inv_freq, self.attention_factor = compute_inv_freq(rope, head_dim, max_position_embeddings)
        self.max_positions = max_positions or max_position_embeddings
        cos, sin = build_cos_sin(inv_freq.to(device), self.attention_factor, self.max_positions)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self._kernel = select_kernel("rope", "apply", platform=platform_of(device), dtype=dtype).impl

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[tokens, heads, head_dim]` and k `[tokens, kv_heads, head_dim]`."""
        return self._kernel(q, k, positions, self.cos_cache, self.sin_cache)

    def extra_repr(self) -> str:
        return f"type={self.rope.rope_type}, theta={self.rope.theta}, rotary_dim={self.rotary_dim}"
