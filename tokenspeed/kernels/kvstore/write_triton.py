"""Triton K/V store: one program per new token writes all its kv heads.

Slots below zero are skipped (CUDA-graph padding, see `reference.py`). The
page and in-page offset are computed from the flat slot so that any cache
strides work, and the page index is widened to int64 because a large pool
overflows 32-bit element offsets. Launched with programmatic dependent launch
on Hopper (`kernels/pdl.py`), which hides most of this tiny kernel's launch.

An fp8 cache (`FP8_CACHE`) gets each head's rows times the reciprocal of its
scale (`HAS_SCALE`; one per head, or one for all: `SCALE_STRIDE` 1 or 0),
rounded to e4m3 by `quant/fp8_cast.to_fp8`, bit for bit as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, kv_scale_args
from tokenspeed.kernels.quant.fp8_cast import quantize_heads
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    k_scale_ptr,
    v_scale_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
):
    if USE_PDL:  # see kernels/pdl.py: wait for the previous kernel before any access
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        src_k = k_ptr + token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
        src_v = v_ptr + token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        dst_k = (
            k_cache_ptr
            + page * stride_kcp
            + offset * stride_kcs
            + offs_h[:, None] * stride_kch
            + offs_d[None, :]
        )
        dst_v = (
            v_cache_ptr
            + page * stride_vcp
            + offset * stride_vcs
            + offs_h[:, None] * stride_vch
            + offs_d[None, :]
        )
        k = tl.load(src_k, mask=mask)
        v = tl.load(src_v, mask=mask)
        if FP8_CACHE:
            k = quantize_heads(k, k_scale_ptr, offs_h, NUM_KV_HEADS, HAS_SCALE, SCALE_STRIDE)
            v = quantize_heads(v, v_scale_ptr, offs_h, NUM_KV_HEADS, HAS_SCALE, SCALE_STRIDE)
        tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@register_kernel(
    "kvstore", "write", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v `[tokens, kv_heads, head_dim]` (last axis contiguous) -> caches at `slot_mapping` (int32/int64).

    fp8 caches: see `reference.write_kv_reference` for the scales.
    """
    tokens, num_kv_heads, head_dim = k.shape
    k_scale_arg, v_scale_arg, has_scale, scale_stride = kv_scale_args(k_scale, v_scale, k_cache, num_kv_heads)
    if tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("kv caches must be contiguous along head_dim")
    for_tensor(_write_kv_kernel, k)[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_scale_arg,
        v_scale_arg,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        FP8_CACHE=k_cache.dtype == FP8_DTYPE,
        HAS_SCALE=has_scale,
        SCALE_STRIDE=scale_stride,
        **pdl_launch_options(pdl_enabled(k.device)),
    )
