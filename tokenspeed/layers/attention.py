"""Grouped-query self-attention over the paged KV cache.

One layer covers Llama, Mistral and Qwen2/3 through flags rather than
subclasses: optional q/k/v bias (Qwen2), optional per-head q/k RMSNorm before
RoPE (Qwen3), and a per-layer sliding window (Mistral, Qwen with
`use_sliding_window`). The attention kernels (K/V store, decode, extend) are
chosen once here into a `PagedAttentionBackend`; the window is passed as a
trait so a kernel without sliding-window support is never picked for a layer
that needs it.

Where `kvstore.rope_write` has a fast kernel (Triton, on CUDA), the q/k norms,
RoPE and the K/V store run as that one kernel before the backend attends; its
REFERENCE (`--kernel kvstore.rope_write=reference`, and the CPU) keeps them
separate kernels, each with its own switch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenspeed.kernels.registry import Band, platform_of, select_kernel
from tokenspeed.layers.attention_backend import PagedAttentionBackend
from tokenspeed.layers.kv_scales import KVScales
from tokenspeed.layers.linear import Linear, QKVLinear
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.rotary_embedding import RotaryEmbedding

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import AttentionMetadata


class GQAAttention(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool = False,
        o_proj_bias: bool = False,
        qk_norm_eps: float | None = None,
        sliding_window: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} kv heads")
        if rotary.head_dim != head_dim:
            raise ValueError(f"rotary head_dim {rotary.head_dim} != attention head_dim {head_dim}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.qkv_proj = QKVLinear(
            hidden_size,
            head_dim=head_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            bias=qkv_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_proj_bias, dtype=dtype, device=device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype=dtype, device=device)
        self.rotary = rotary
        self.kv_scales = KVScales(device=device, num_kv_heads=num_kv_heads)
        self.attention_backend = PagedAttentionBackend.select(
            platform=platform_of(device),
            dtype=dtype,
            head_dim=head_dim,
            sliding_window=sliding_window is not None,
        )
        rope_write = select_kernel("kvstore", "rope_write", platform=platform_of(device), dtype=dtype)
        self.rope_write = rope_write.impl if rope_write.band > Band.REFERENCE else None

    @property
    def decode_max_tokens(self) -> int:
        """Most tokens the fused decode form of `forward` (input_norm / residual) serves; -1: none."""
        return min(self.qkv_proj.decode_max_tokens, self.o_proj.decode_max_tokens)

    def _stored_keys(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """K as the cache stores it (k-norm, then RoPE), for scale calibration only: the fused path
        (`rope_write`) applies both inside its kernel, so its own K is not that yet."""
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self.rotary(positions, q.clone(), k.clone())[1]

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        attn: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        input_norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden `[tokens, hidden_size]` -> `[tokens, hidden_size]`; this step's K/V land in the caches.

        Decode form (at most `decode_max_tokens` rows): `input_norm` is applied
        to `hidden` inside the QKV kernel and `residual` added inside the o_proj
        kernel, so the result is the residual stream and no norm kernel runs.
        """
        tokens = hidden.shape[0]
        if input_norm is not None:
            qkv = self.qkv_proj.forward_decode(hidden, norm_weight=input_norm.weight, eps=input_norm.eps)
        else:
            qkv = self.qkv_proj(hidden)
        q, k, v = self.qkv_proj.split_output(qkv)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.kv_scales.calibrating:
            self.kv_scales.observe(self._stored_keys(positions, q, k), v)
        k_scale, v_scale = self.kv_scales.for_cache(k_cache)
        if self.rope_write is not None:
            norms = {}
            if self.q_norm is not None and self.k_norm is not None:
                norms = {"q_norm_weight": self.q_norm.weight, "k_norm_weight": self.k_norm.weight,
                         "norm_eps": self.q_norm.eps}
            q = self.rope_write(q, k, v, positions, self.rotary.cos_cache, self.rotary.sin_cache, k_cache, v_cache,
                                attn.slot_mapping, k_scale=k_scale, v_scale=v_scale, **norms)
            out = self.attention_backend.attend(q, k_cache, v_cache, attn, scale=self.scale,
                                                sliding_window=self.sliding_window, k_scale=k_scale, v_scale=v_scale)
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q, k = self.rotary(positions, q, k)
            out = self.attention_backend(
                q, k, v, k_cache, v_cache, attn, scale=self.scale, sliding_window=self.sliding_window,
                k_scale=k_scale, v_scale=v_scale,
            )
        flat = out.reshape(tokens, self.num_heads * self.head_dim)
        if residual is not None:
            return self.o_proj.forward_decode(flat, residual=residual)
        return self.o_proj(flat)
