"""Triton MLA cache write: one program per token stores its latent+rope row at its flat slot.

The torch reference needs a redirect trick to skip padding slots without a
host sync; here a program simply returns when its slot is negative, which
also keeps the write a single launch that a CUDA graph captures as is.
An fp8 cache stores row / kv_scale rounded to e4m3 (`quant/fp8_cast.py`),
bit for bit as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, kv_scale_args
from tokenspeed.kernels.quant.fp8_cast import to_fp8
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2


@triton.jit
def _mla_write_kernel(
    src_ptr,
    cache_ptr,
    slot_ptr,
    scale_ptr,
    stride_src,
    stride_cp,
    stride_cs,
    WIDTH: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < WIDTH
        row = tl.load(src_ptr + token.to(tl.int64) * stride_src + offs, mask=mask)
        if FP8_CACHE:
            row = row.to(tl.float32)
            if HAS_SCALE:
                row = row * tl.math.div_rn(1.0, tl.load(scale_ptr))
            row = to_fp8(row)
        dst = cache_ptr + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + offs
        tl.store(dst, row.to(cache_ptr.dtype.element_ty), mask=mask)


@register_kernel("mla", "write", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES)
def mla_write_triton(
    latent_and_rope: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Rows `[T, Dl+Dr]` -> `cache [num_pages, page_size, 1, Dl+Dr]` at flat slots; negative slots skipped.

    fp8 e4m3 caches: rows / kv_scale (fp32 `[1]`; None: 1.0).
    """
    tokens, width = latent_and_rope.shape
    if cache.shape[2] != 1 or cache.shape[3] != width:
        raise ValueError(f"cache {tuple(cache.shape)} does not hold rows of width {width}")
    if latent_and_rope.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("rows and the cache must be contiguous along the last dim")
    if tokens == 0:
        return
    scale, _, has_scale, _ = kv_scale_args(kv_scale, kv_scale, cache, 1)
    for_tensor(_mla_write_kernel, latent_and_rope)[(tokens,)](
        latent_and_rope,
        cache,
        slot_mapping,
        scale,
        latent_and_rope.stride(0),
        cache.stride(0),
        cache.stride(1),
        WIDTH=width,
        PAGE_SIZE=cache.shape[1],
        BLOCK=next_power_of_2(width),
        FP8_CACHE=cache.dtype == FP8_DTYPE,
        HAS_SCALE=has_scale,
        num_warps=4,
    )
