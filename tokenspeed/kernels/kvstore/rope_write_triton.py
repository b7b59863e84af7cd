"""Triton `kvstore.rope_write`: q/k norm, RoPE and the K/V store of a step in one kernel.

Before it attends, an attention layer ran up to four small kernels per step:
Qwen3's per-head RMSNorm of q and of k, the rotary embedding, and the K/V
store. At decode each moves a few KB and costs mostly its launch and the wait
on the previous kernel (a bs1 Llama-3.1-8B bf16 decode step on an H200 was
about 270 launches in 4 ms, `benchmarks/results/h200/fp8/fp8_e2e_llama.bf16.profile.txt`),
so this kernel does all of them: one program per token loads the token's q, k and v heads once,
normalises q and k (if the layer has q_norm / k_norm), rotates them, writes q
back in place (it is a view of the fused QKV output, as for `rope.apply`) and
stores k and v in the paged cache (fp8 caches with their per-head scales, as
`kvstore.write`). k is not written back: only the cache is read after this.

Numerics follow the unfused kernels step by step (`reference.rope_write_reference`):
the normalised value rounds to the activation dtype before the weight
multiplies it, the weighted value rounds again, RoPE runs in fp32 on those
and rounds once. A head is handled as three parts, the two rotated halves of
the first `rotary_dim` channels and the channels past them (partial rotary),
so no register tile is sliced.

Slots below zero are skipped (CUDA-graph padding), q is rotated regardless.
Launched with programmatic dependent launch on Hopper (`kernels/pdl.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.kvstore.reference import check_norm_weights
from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, kv_scale_args
from tokenspeed.kernels.quant.fp8_cast import quantize_heads
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.rope.rope_triton import position_cos_sin
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2


@triton.jit
def _load_parts(rows, heads, NUM_HEADS: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
                BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """A token's heads as (first half, second half of the rotary channels, the rest)."""
    offs_half = tl.arange(0, BLOCK_HALF)[None, :]
    offs_rest = tl.arange(0, BLOCK_REST)[None, :]
    half_mask = (heads[:, None] < NUM_HEADS) & (offs_half < HALF)
    rest_mask = (heads[:, None] < NUM_HEADS) & (offs_rest < REST)
    lo = tl.load(rows + offs_half, mask=half_mask, other=0.0)
    hi = tl.load(rows + HALF + offs_half, mask=half_mask, other=0.0)
    rest = tl.load(rows + 2 * HALF + offs_rest, mask=rest_mask, other=0.0)
    return lo, hi, rest


@triton.jit
def _store_parts(rows, heads, lo, hi, rest, NUM_HEADS: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    offs_half = tl.arange(0, BLOCK_HALF)[None, :]
    offs_rest = tl.arange(0, BLOCK_REST)[None, :]
    half_mask = (heads[:, None] < NUM_HEADS) & (offs_half < HALF)
    rest_mask = (heads[:, None] < NUM_HEADS) & (offs_rest < REST)
    dtype = rows.dtype.element_ty
    tl.store(rows + offs_half, lo.to(dtype), mask=half_mask)
    tl.store(rows + HALF + offs_half, hi.to(dtype), mask=half_mask)
    tl.store(rows + 2 * HALF + offs_rest, rest.to(dtype), mask=rest_mask)


@triton.jit
def _norm_rope(lo, hi, rest, w_ptr, eps, cos, sin, HALF: tl.constexpr, REST: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
               HAS_NORM: tl.constexpr):
    """Per-head RMSNorm (HAS_NORM) then RoPE of the rotary halves, rounded as the unfused kernels."""
    dtype = lo.dtype
    if HAS_NORM:
        offs_half = tl.arange(0, BLOCK_HALF)
        offs_rest = tl.arange(0, BLOCK_REST)
        lo32, hi32, rest32 = lo.to(tl.float32), hi.to(tl.float32), rest.to(tl.float32)
        squares = tl.sum(lo32 * lo32, 1) + tl.sum(hi32 * hi32, 1) + tl.sum(rest32 * rest32, 1)
        rstd = tl.rsqrt(squares / HEAD_DIM + eps)[:, None]
        w_lo = tl.load(w_ptr + offs_half, mask=offs_half < HALF, other=0.0).to(tl.float32)[None, :]
        w_hi = tl.load(w_ptr + HALF + offs_half, mask=offs_half < HALF, other=0.0).to(tl.float32)[None, :]
        w_rest = tl.load(w_ptr + 2 * HALF + offs_rest, mask=offs_rest < REST, other=0.0).to(tl.float32)[None, :]
        lo = (w_lo * (lo32 * rstd).to(dtype).to(tl.float32)).to(dtype)
        hi = (w_hi * (hi32 * rstd).to(dtype).to(tl.float32)).to(dtype)
        rest = (w_rest * (rest32 * rstd).to(dtype).to(tl.float32)).to(dtype)
    x1 = lo.to(tl.float32)
    x2 = hi.to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype), rest


@triton.jit
def _rope_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    REST: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # Positions, slots and the cos/sin tables are not the previous kernel's output: read before the wait (kernels/pdl.py).
    cos, sin = position_cos_sin(positions_ptr, token, cos_ptr, sin_ptr, stride_cos, HALF, BLOCK_HALF)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if USE_PDL:  # see kernels/pdl.py: wait for the previous kernel before reading q, k, v
        gdc_wait()
        gdc_launch_dependents()

    q_heads = tl.arange(0, BLOCK_QH)
    q_rows = q_ptr + token * stride_qt + q_heads[:, None] * stride_qh
    kv_heads = tl.arange(0, BLOCK_KH)
    k_rows = k_ptr + token * stride_kt + kv_heads[:, None] * stride_kh
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    v_mask = (kv_heads[:, None] < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    v_rows = v_ptr + token * stride_vt + kv_heads[:, None] * stride_vh + offs_d
    # q, k and v requested together, before any store (a store of q would otherwise hold back the loads of k)
    lo, hi, rest = _load_parts(q_rows, q_heads, NUM_Q_HEADS, HALF, REST, BLOCK_HALF, BLOCK_REST)
    k_lo, k_hi, k_rest = _load_parts(k_rows, kv_heads, NUM_KV_HEADS, HALF, REST, BLOCK_HALF, BLOCK_REST)
    v = tl.load(v_rows, mask=v_mask, other=0.0)
    lo, hi, rest = _norm_rope(lo, hi, rest, q_norm_ptr, eps, cos, sin, HALF, REST, HEAD_DIM, BLOCK_HALF,
                              BLOCK_REST, HAS_NORM)
    _store_parts(q_rows, q_heads, lo, hi, rest, NUM_Q_HEADS, HALF, REST, BLOCK_HALF, BLOCK_REST)

    if slot >= 0:
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        k_dst = k_cache_ptr + page * stride_kcp + offset * stride_kcs + kv_heads[:, None] * stride_kch
        v_dst = v_cache_ptr + page * stride_vcp + offset * stride_vcs + kv_heads[:, None] * stride_vch + offs_d
        k_lo, k_hi, k_rest = _norm_rope(k_lo, k_hi, k_rest, k_norm_ptr, eps, cos, sin, HALF, REST, HEAD_DIM,
                                        BLOCK_HALF, BLOCK_REST, HAS_NORM)
        if FP8_CACHE:  # new names: the fp8 codes are another type than the loaded k / v
            k_lo8 = quantize_heads(k_lo, k_scale_ptr, kv_heads, NUM_KV_HEADS, HAS_SCALE, SCALE_STRIDE)
            k_hi8 = quantize_heads(k_hi, k_scale_ptr, kv_heads, NUM_KV_HEADS, HAS_SCALE, SCALE_STRIDE)
            k_rest8 = quantize_heads(k_rest, k_scale_ptr, kv_heads, NUM_KV_HEADS, HAS_SCALE, SCALE_STRIDE)
            _store_parts(k_dst, kv_heads, k_lo8, k_hi8, k_rest8, NUM_KV_HEADS, HALF, REST, BLOCK_HALF, BLOCK_REST)
            v8 = quantize_heads(v, v_scale_ptr, kv_heads, NUM_KV_HEADS, HAS_SCALE, SCALE_STRIDE)
            tl.store(v_dst, v8, mask=v_mask)
        else:
            _store_parts(k_dst, kv_heads, k_lo, k_hi, k_rest, NUM_KV_HEADS, HALF, REST, BLOCK_HALF, BLOCK_REST)
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


@register_kernel(
    "kvstore", "rope_write", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def rope_write_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `reference.rope_write_reference`; q `[tokens, heads, head_dim]` is rotated in place and returned."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    has_norm = check_norm_weights(q_norm_weight, k_norm_weight)
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous along head_dim to be rotated in place")
    if cos_cache.stride(-1) != 1 or sin_cache.stride(0) != cos_cache.stride(0):
        raise ValueError("cos/sin caches must be contiguous tables of the same layout")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("kv caches must be contiguous along head_dim")
    k_scale_arg, v_scale_arg, has_scale, scale_stride = kv_scale_args(k_scale, v_scale, k_cache, num_kv_heads)
    if tokens == 0:
        return q
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    half = cos_cache.shape[-1]
    rest = head_dim - 2 * half
    for_tensor(_rope_write_kernel, q)[(tokens,)](
        q, k, v, positions, cos_cache, sin_cache,
        q_norm_weight if q_norm_weight is not None else q, k_norm_weight if k_norm_weight is not None else q,
        norm_eps, k_cache, v_cache, slot_mapping, k_scale_arg, v_scale_arg,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half, REST=rest,
        PAGE_SIZE=k_cache.shape[1], BLOCK_QH=next_power_of_2(num_heads), BLOCK_KH=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(half), BLOCK_REST=next_power_of_2(max(rest, 1)),
        BLOCK_D=next_power_of_2(head_dim), HAS_NORM=has_norm,
        FP8_CACHE=k_cache.dtype == FP8_DTYPE, HAS_SCALE=has_scale, SCALE_STRIDE=scale_stride,
        num_warps=4, **pdl_launch_options(pdl_enabled(q.device)),
    )  # fmt: skip
    return q
