"""Building blocks of the trainable networks, with the arithmetic of the Hugging Face modules they mirror.

The training networks are our own small modules rather than `transformers`'
classes so that one code path trains both models, the draft heads get the
target's final hidden states directly, the MoE can compute every expert
densely (at this size one matmul over all experts beats any gather/scatter and
compiles into a single graph), and `torch.compile` sees no Python-side cache
or mask machinery. Parameter names are the checkpoint names, and the tests
check the logits against `transformers` on the same weights, so nothing is
lost in loadability. Attention is causal over a packed window (no padding):
`scaled_dot_product_attention(is_causal=True)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """As transformers: normalise in fp32, cast back, then scale (weight starts at one)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`, the MLP of Llama, Qwen and DeepSeek (names `gate_proj`...)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_tables(
    length: int, dim: int, theta: float, device: torch.device, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[length, dim]` of positions offset.. (default rope: `cat(freqs, freqs)`), fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    positions = torch.arange(offset, offset + length, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on `[batch, heads, seq, dim]` (Llama / Qwen layout)."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: pairs (x0, x1), (x2, x3)... share a frequency; the result comes out de-interleaved.

    Queries and keys both come out in the same order, so their dot products
    are those of the interleaved rotation (what transformers computes too).
    """
    half = x.shape[-1] // 2
    c, s = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`[batch, heads, seq, dim]` causal attention; k/v with fewer heads are repeated (GQA, HF order).

    q and k leave their norms and rope in fp32; v comes straight from a linear
    layer, so its dtype is autocast's (bf16 on the GPU): all three run in it,
    which is what lets SDPA pick its flash kernel.
    """
    q, k = q.to(v.dtype), k.to(v.dtype)
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    if v.shape[-1] != q.shape[-1]:  # MLA: fused kernels want one head size; pad v and cut the output
        out = F.scaled_dot_product_attention(
            q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])), is_causal=True, scale=scale
        )
        return out[..., : v.shape[-1]]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class GroupedQueryAttention(nn.Module):
    """Llama attention (`q_proj`...`o_proj`, GQA, rotate-half rope); Qwen3 adds per-head `q_norm`/`k_norm`."""

    def __init__(self, config: Mapping[str, Any], qk_norm: bool) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config["head_dim"]
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config["rms_norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config["rms_norm_eps"]) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        out = causal_attention(q, k, v, self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def init_weights(module: nn.Module, std: float, num_layers: int) -> None:
    """Normal(0, std) everywhere, output projections scaled by 1/sqrt(2 * layers) (GPT-2), norms at one."""
    residual_std = std / (2 * max(num_layers, 1)) ** 0.5
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif name.endswith("bias"):
            nn.init.zeros_(param)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "experts_down")):
            nn.init.normal_(param, std=residual_std)
        else:
            nn.init.normal_(param, std=std)
