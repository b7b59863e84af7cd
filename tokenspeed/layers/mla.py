"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) over a paged latent cache.

Why this shape: MLA compresses each token's keys and values into one latent
c_kv (`kv_lora_rank` values, RMS-normalised) plus one rope key k_pe shared by
all heads (`qk_rope_head_dim` values). Only `latent ‖ k_pe` is cached, 576
values per token and layer for V3, instead of 2·heads·head_dim.

Attention runs in the *weight-absorbed* form for prefill and decode alike.
`kv_b_proj` (`[H·(nope+v), kv_lora_rank]`) holds per head W_UK (`[nope, Dl]`)
and W_UV (`[v, Dl]`). Since k_nope = W_UK·c_kv, the score q_nope·k_nope equals
(W_UKᵀ·q_nope)·c_kv: the query is moved into the latent space once per token
and head, every head then attends to the one shared latent "head" (MQA with
key width Dl + Dr, value = the latent itself), and the output is mapped back
with W_UV. Nothing per cached token is ever decompressed, which is what makes
decode memory-bound on 576 values per token rather than on H·(nope+v).
Absorbed prefill costs more FLOPs than the expanded form for long chunks
(Dl = 512 > nope = 128), but keeps one code path and one kernel family; the
`mla.extend` kernel is free to pick its own schedule.

RoPE: DeepSeek checkpoints lay the rope channels out in interleaved pairs
(x0, x1), (x2, x3), ... V3 (`rope_interleave`) rotates the even/odd slices
and returns them de-interleaved; V2 multiplies complex pairs and keeps them
interleaved. Both rotate the same pairs by the same angles, so de-interleaving
q_pe and k_pe before the shared rotate-half kernel gives V3's output exactly
and V2's up to one fixed permutation of channels, applied to q and k alike,
which leaves every dot product (the only use of k_pe) unchanged.

Scale: qk_head_dim^-0.5, times mscale² with mscale = 0.1·mscale_all_dim·ln(factor) + 1
under YaRN (as transformers' `yarn_apply_mscale`); YaRN's own attention factor
is already folded into the cos/sin tables by `RotaryEmbedding`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenspeed.kernels.registry import KernelSpec, platform_of, select_kernel
from tokenspeed.layers.attention_backend import VERIFY_MAX_QUERY_LEN, int_tensor_field, uniform_query_len
from tokenspeed.layers.kv_scales import KVScales
from tokenspeed.layers.linear import Linear, MergedLinear
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.rope_scaling import RopeConfig, yarn_mscale
from tokenspeed.layers.rotary_embedding import RotaryEmbedding

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import AttentionMetadata
    from tokenspeed.layers.mla_config import MLAConfig


def mla_softmax_scale(mla: MLAConfig, rope: RopeConfig, max_position_embeddings: int) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)² under a scaled rope (transformers' rule)."""
    scale = mla.qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        factor = rope.factor
        if factor is None:  # transformers' fallback: the context extension ratio
            original = rope.original_max_position_embeddings or max_position_embeddings
            factor = max_position_embeddings / original
        mscale = yarn_mscale(factor, rope.mscale_all_dim)
        scale *= mscale * mscale
    return scale


@dataclass(frozen=True, slots=True)
class MLABackend:
    """The latent-cache kernels of one MLA layer, chosen once when the model is built."""

    write: KernelSpec
    decode: KernelSpec
    extend: KernelSpec

    @classmethod
    def select(cls, *, platform: str, dtype: torch.dtype) -> MLABackend:
        """Best kernel per mode (overrides: `TOKENSPEED_KERNEL_MLA_DECODE=reference`, ...)."""
        return cls(
            write=select_kernel("mla", "write", platform=platform, dtype=dtype),
            decode=select_kernel("mla", "decode", platform=platform, dtype=dtype),
            extend=select_kernel("mla", "extend", platform=platform, dtype=dtype),
        )

    def __call__(
        self,
        q: torch.Tensor,
        latent_and_rope: torch.Tensor,
        cache: torch.Tensor,
        attn: AttentionMetadata,
        *,
        scale: float,
        kv_lora_rank: int,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store `[T, Dl+Dr]` rows, then attend q `[T, H, Dl+Dr]`; latent-space output `[T, H, Dl]`.
        `kv_scale`: the fp8 latent cache's static scale (None: a cache in the model dtype)."""
        self.write.impl(latent_and_rope, cache, attn.slot_mapping, kv_scale=kv_scale)
        seq_lens = int_tensor_field(attn, "seq_lens", q.device)
        q_len = uniform_query_len(attn, q.shape[0], seq_lens.shape[0])
        if q_len is not None and q_len <= VERIFY_MAX_QUERY_LEN:  # decode, or verify rows (q-head folding)
            return self.decode.impl(
                q,
                cache,
                attn.page_table,
                seq_lens,
                q_len=q_len,
                scale=scale,
                kv_lora_rank=kv_lora_rank,
                num_splits=attn.num_kv_splits,
                kv_scale=kv_scale,
            )
        return self.extend.impl(
            q,
            cache,
            int_tensor_field(attn, "query_start", q.device),
            seq_lens,
            attn.page_table,
            scale=scale,
            kv_lora_rank=kv_lora_rank,
            max_query_len=attn.max_query_len,
            kv_scale=kv_scale,
        )

    def __repr__(self) -> str:
        return f"MLABackend(write={self.write.name}, decode={self.decode.name}, extend={self.extend.name})"


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): pairs become rotate-half halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAAttention(nn.Module):
    """hidden `[T, hidden]` -> `[T, hidden]`; the step's latent ‖ rope key lands in the paged cache.

    Parameter names follow HF (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`,
    `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), except that
    the projections reading the hidden state (`q_proj` or `q_a_proj`, and
    `kv_a_proj_with_mqa`) are one fused GEMM `fused_qkv_a_proj` whose shards
    the model's `packed_modules` names.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        mla: MLAConfig,
        rotary: RotaryEmbedding,
        scale: float,
        rms_norm_eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if rotary.head_dim != mla.qk_rope_head_dim or rotary.rotary_dim != mla.qk_rope_head_dim:
            raise ValueError(f"rotary width {rotary.rotary_dim} != qk_rope_head_dim {mla.qk_rope_head_dim}")
        self.num_heads = num_heads
        self.mla = mla
        self.scale = scale
        self.rotary = rotary
        q_shard = "q" if mla.q_lora_rank is None else "q_a"
        q_width = num_heads * mla.qk_head_dim if mla.q_lora_rank is None else mla.q_lora_rank
        self.fused_qkv_a_proj = MergedLinear(
            hidden_size, {q_shard: q_width, "kv_a": mla.cache_dim}, dtype=dtype, device=device
        )
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, rms_norm_eps, dtype=dtype, device=device)
            self.q_b_proj = Linear(mla.q_lora_rank, num_heads * mla.qk_head_dim, dtype=dtype, device=device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, rms_norm_eps, dtype=dtype, device=device)
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), dtype=dtype, device=device
        )
        self.o_proj = Linear(num_heads * mla.v_head_dim, hidden_size, dtype=dtype, device=device)
        self.backend = MLABackend.select(platform=platform_of(device), dtype=dtype)
        self.kv_scales = KVScales(device=device)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of `kv_b_proj.weight`: W_UK `[H, nope, Dl]` and W_UV^T `[H, Dl, v]` (no copies, so a
        later load into `kv_b_proj` is seen at once)."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :].transpose(1, 2)

    def project(
        self, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope `[T, H, nope]`, rotated q_pe `[T, H, Dr]`, cache rows latent ‖ rotated k_pe `[T, Dl+Dr]`)."""
        m = self.mla
        tokens = hidden.shape[0]
        q, kv_a = self.fused_qkv_a_proj.split_output(self.fused_qkv_a_proj(hidden))
        if self.q_b_proj is not None and self.q_a_layernorm is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(tokens, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(1)
        if m.rope_interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        return q_nope, q_pe, torch.cat((self.kv_a_layernorm(latent), k_pe.squeeze(1)), dim=-1)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        attn: AttentionMetadata,
        cache: torch.Tensor,
        _unused_v_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q_nope, q_pe, cache_rows = self.project(positions, hidden)
        if self.kv_scales.calibrating:
            self.kv_scales.observe(cache_rows)  # one latent cache, one scale (`k_scale`)
        w_uk, w_uv_t = self.absorbed_weights()
        # [H, T, nope] @ [H, nope, Dl] -> [H, T, Dl]: the query in latent space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q = torch.cat((q_latent, q_pe), dim=-1)
        out = self.backend(
            q, cache_rows, cache, attn, scale=self.scale, kv_lora_rank=self.mla.kv_lora_rank,
            kv_scale=self.kv_scales.for_cache(cache)[0],
        )  # [T, H, Dl]
        out = torch.bmm(out.transpose(0, 1), w_uv_t)  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(tokens, self.num_heads * self.mla.v_head_dim))
