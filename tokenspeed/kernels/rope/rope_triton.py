"""Triton rotary embedding (rotate-half / NeoX layout), in place on q and k.

The cos/sin tables come from `layers/rotary_embedding.py`, where default,
linear, llama3 and YaRN scaling differ only in how the tables are built, so
this one kernel serves them all. One program rotates every head of q and k for
one token, reading that position's cos/sin row once. In place, because q and k
are views of the fused QKV projection: rotating them there saves two copies.
Only the first `rotary_dim` channels rotate (partial rotary); the rest stay.
Launched with programmatic dependent launch on Hopper (`kernels/pdl.py`): a
two-microsecond kernel otherwise spends much of its time being launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2


@triton.jit
def position_cos_sin(positions_ptr, token, cos_ptr, sin_ptr, stride_cos, HALF: tl.constexpr,
                     BLOCK_HALF: tl.constexpr):
    """The cos and sin rows `[1, BLOCK_HALF]` (fp32) of `token`'s position, also for `kvstore.rope_write`."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see kernels/pdl.py: wait for the previous kernel before any access
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cos, sin = position_cos_sin(positions_ptr, token, cos_ptr, sin_ptr, stride_cos, HALF, BLOCK_HALF)
    offs = tl.arange(0, BLOCK_HALF)
    c_mask = offs < HALF

    heads = tl.arange(0, BLOCK_QH)
    mask = (heads[:, None] < NUM_Q_HEADS) & c_mask[None, :]
    first = q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)

    heads = tl.arange(0, BLOCK_KH)
    mask = (heads[:, None] < NUM_K_HEADS) & c_mask[None, :]
    first = k_ptr + token * stride_kt + heads[:, None] * stride_kh + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=mask)


@register_kernel("rope", "apply", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES)
def apply_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[tokens, heads, head_dim]` and k `[tokens, kv_heads, head_dim]` in place; returns (q, k).

    cos_cache/sin_cache: `[max_positions, rotary_dim // 2]`; positions `[tokens]` (any integer dtype).
    """
    tokens = q.shape[0]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must be contiguous along head_dim to be rotated in place")
    if cos_cache.stride(-1) != 1 or sin_cache.stride(0) != cos_cache.stride(0):
        raise ValueError("cos/sin caches must be contiguous tables of the same layout")
    half = cos_cache.shape[-1]
    if tokens:
        for_tensor(_rope_kernel, q)[(tokens,)](
            q,
            k,
            positions,
            cos_cache,
            sin_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_cache.stride(0),
            NUM_Q_HEADS=q.shape[1],
            NUM_K_HEADS=k.shape[1],
            HALF=half,
            BLOCK_QH=next_power_of_2(q.shape[1]),
            BLOCK_KH=next_power_of_2(k.shape[1]),
            BLOCK_HALF=next_power_of_2(half),
            num_warps=4,
            **pdl_launch_options(pdl_enabled(q.device)),
        )
    return q, k
