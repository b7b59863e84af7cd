"""Triton paged prefill/extend attention for mixed batches (flash-attention style).

Each row's new tokens (q_len of them) sit at positions `seq_len - q_len ..
seq_len - 1` and attend to every cached position before them, including the
new tokens themselves, which the caller has already stored in the cache. So
one kernel covers a fresh prompt, a prompt chunk after a cached prefix (the
agentic case: 96% of the prompt was seen last turn) and decode rows mixed in.

A program owns BLOCK_M new tokens of one row and one query head and streams
that row's keys in BLOCK_N blocks through the page table with an online
softmax. Key blocks wholly before the tile's first query need no causal mask,
so the mask is only built on the diagonal (and everywhere with a sliding
window). Grid axis 0 enumerates query tiles with the *last* ones first: they
see the most keys, and starting them early balances the tail. Element offsets
into the cache are 64-bit because a large pool overflows 32 bits.

FP8 KV cache: as in `decode_triton`, the dots run in fp16 (`F16_DOTS` for a
bf16 query), tiles are widened in registers, the key scale of the program's
kv head is folded into the softmax scale and its value scale multiplies the
output once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.attention.paged_tiles import dot, gather_kv_tile, online_softmax_step
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, kv_scale_args
from tokenspeed.kernels.quant.fp8_cast import to_f16_saturated, widen_fp8
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2

LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_ptr,
    seq_lens_ptr,
    page_table_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2e,
    window,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ot,
    stride_oh,
    M_BLOCKS,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
    F16_DOTS: tl.constexpr,
):
    m_block = M_BLOCKS - 1 - tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    q_start = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_start
    if m_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + row)
        prefix = seq_len - q_len
        kv_head = head // GROUP
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        q_pos = prefix + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        tokens = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if F16_DOTS:  # an fp8 cache under a bf16 query: fp16 dots, as in decode_triton
            q = to_f16_saturated(q)

        first_q = prefix + m_block * BLOCK_M
        hi = tl.minimum(seq_len, first_q + BLOCK_M)
        lo = first_q * 0
        if HAS_WINDOW:
            lo = tl.maximum(first_q - window + 1, 0)
        unmasked_end = first_q + 1  # keys before this are visible to every query of the tile
        if HAS_SCALE:  # fp8 keys: k = k_fp8 * k_scale, folded into the softmax scale
            scale_log2e = scale_log2e * tl.load(k_scale_ptr + kv_head * SCALE_STRIDE)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        table = page_table_ptr + row.to(tl.int64) * stride_pt
        for block_start in range(lo, hi, BLOCK_N):
            pos = block_start + tl.arange(0, BLOCK_N)
            n_mask = pos < hi
            page = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            slot = pos % PAGE_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = gather_kv_tile(k_cache_ptr, page, slot, kv_head, stride_kp, stride_ks, stride_kh, offs_d, kv_mask)
            scores = dot(q, tl.trans(widen_fp8(k, q.dtype, False)), IEEE) * scale_log2e
            if HAS_WINDOW or block_start + BLOCK_N > unmasked_end:
                visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
                if HAS_WINDOW:
                    visible = visible & ((q_pos[:, None] - pos[None, :]) < window)
                scores = tl.where(visible, scores, float("-inf"))
            v = gather_kv_tile(v_cache_ptr, page, slot, kv_head, stride_vp, stride_vs, stride_vh, offs_d, kv_mask)
            m_i, l_i, acc = online_softmax_step(scores, widen_fp8(v, q.dtype, True), m_i, l_i, acc, IEEE)

        if HAS_SCALE:
            acc = acc * tl.load(v_scale_ptr + kv_head * SCALE_STRIDE)
        result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        dst = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _tile_sizes(head_dim: int, dtype: torch.dtype, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): big tiles for long prompts, small ones for short rows."""
    if max_query_len <= 16:
        return 16, 64, 4, 2
    if dtype == torch.float32:
        return 32, 32, 4, 2
    if head_dim > 128:
        return 64, 32, 4, 2
    if max_query_len <= 64:
        return 64, 64, 4, 2
    return 128, 64, 8, 2


@register_kernel(
    "attention", "extend", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[tokens, heads, head_dim]`; query_start `[rows + 1]`, seq_lens `[rows]`, page_table `[rows, max_pages]`.

    `max_query_len` sizes the grid; pass it (the executor knows it) to avoid a
    device-to-host read of query_start. Returns `[tokens, heads, head_dim]`.
    fp8 e4m3 caches take `k_scale` / `v_scale` (fp32 `[kv_heads]` or `[1]`; None: 1.0).
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} kv heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the kv caches must be contiguous along head_dim")
    out = torch.empty_like(q)
    rows = seq_lens.shape[0]
    if tokens == 0 or rows == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max())
    k_scale_arg, v_scale_arg, has_scale, scale_stride = kv_scale_args(k_scale, v_scale, k_cache, num_kv_heads)
    block_m, block_n, num_warps, num_stages = _tile_sizes(head_dim, q.dtype, max_query_len)
    m_blocks = -(-max_query_len // block_m)
    for_tensor(_extend_kernel, q)[(m_blocks, num_heads, rows)](
        q,
        k_cache,
        v_cache,
        query_start,
        seq_lens,
        page_table,
        out,
        k_scale_arg,
        v_scale_arg,
        scale * LOG2E,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        m_blocks,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        HAS_WINDOW=sliding_window is not None,
        IEEE=q.dtype == torch.float32,
        HAS_SCALE=has_scale,
        SCALE_STRIDE=scale_stride,
        F16_DOTS=k_cache.dtype == FP8_DTYPE and q.dtype == torch.bfloat16,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
