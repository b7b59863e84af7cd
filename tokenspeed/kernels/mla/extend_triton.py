"""Triton MLA extend (prefill chunks after a cached prefix, mixed with decode rows), absorbed form.

Each row's new tokens sit at positions `seq_len - q_len .. seq_len - 1` of its
paged latent cache (this step's rows already written) and attend to every
position up to their own. A program owns a tile of BLOCK_M query rows made of
`TOKENS` consecutive new tokens x `HEADS_PER_BLOCK` heads of one row: all heads
share the latent "kv head", so heads fill the tile first (a decode row mixed
into the batch still uses a whole tile), and for few heads the tile takes
several tokens. Keys stream through the page table with an online softmax
up to the tile's last token (`tiles.attend_latent_range`, shared with
decode). Grid axis 0 runs the *last* token tiles first: they see the most
keys, and starting them early balances the tail.

Correctness first: the causal mask is applied on every key block, and there is
no split of long prefixes (prefill tiles are numerous enough to fill the GPU).
fp8 caches: as in `decode_triton` (tiles widened on load, fp16 dots under a bf16 query, scale folded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.mla.tiles import attend_latent_range, load_query_tile, store_latent_output
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, kv_scale_args
from tokenspeed.kernels.quant.fp8_cast import to_f16_saturated
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2

LOG2E = 1.4426950408889634


@triton.jit
def _mla_extend_kernel(
    q_ptr,
    cache_ptr,
    query_start_ptr,
    seq_lens_ptr,
    page_table_ptr,
    out_ptr,
    kv_scale_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_pt,
    stride_ot,
    stride_oh,
    TOKEN_BLOCKS,
    NUM_HEADS: tl.constexpr,
    TOKENS: tl.constexpr,
    HEADS_PER_BLOCK: tl.constexpr,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    F16_DOTS: tl.constexpr,
):
    token_block = TOKEN_BLOCKS - 1 - tl.program_id(0)
    head_block = tl.program_id(1)
    row = tl.program_id(2)
    q_start = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_start
    if token_block * TOKENS < q_len:
        seq_len = tl.load(seq_lens_ptr + row)
        offs_m = tl.arange(0, BLOCK_M)
        j = token_block * TOKENS + offs_m // HEADS_PER_BLOCK
        head = head_block * HEADS_PER_BLOCK + offs_m % HEADS_PER_BLOCK
        m_mask = (offs_m < TOKENS * HEADS_PER_BLOCK) & (j < q_len) & (head < NUM_HEADS)
        token = q_start + j
        q_pos = seq_len - q_len + j
        hi = tl.minimum(seq_len - q_len + (token_block + 1) * TOKENS, seq_len)
        q_lat, q_rope = load_query_tile(
            q_ptr, token, head, m_mask, stride_qt, stride_qh, KV_LORA, ROPE, BLOCK_L, BLOCK_R
        )
        if F16_DOTS:  # an fp8 cache under a bf16 query: fp16 dots (tiles.py)
            q_lat, q_rope = to_f16_saturated(q_lat), to_f16_saturated(q_rope)
        if HAS_SCALE:  # fp8 cache: latent = latent_fp8 * kv_scale, folded into the softmax scale
            scale_log2e = scale_log2e * tl.load(kv_scale_ptr)
        m_i, l_i, acc = attend_latent_range(
            q_lat,
            q_rope,
            q_pos,
            cache_ptr,
            page_table_ptr + row.to(tl.int64) * stride_pt,
            seq_len * 0,
            hi,
            scale_log2e,
            stride_cp,
            stride_cs,
            KV_LORA,
            ROPE,
            PAGE_SIZE,
            BLOCK_M,
            BLOCK_N,
            BLOCK_L,
            BLOCK_R,
            IEEE,
        )
        if HAS_SCALE:  # and into the output (the value is the same latent)
            acc = acc * tl.load(kv_scale_ptr)
        store_latent_output(out_ptr, token, head, m_mask, acc, l_i, stride_ot, stride_oh, KV_LORA, BLOCK_L)


@dataclass(frozen=True, slots=True)
class ExtendTiles:
    """A program's query tile (`tokens` x `heads_per_block` = `block_m` rows) and launch sizes."""

    block_m: int
    heads_per_block: int
    tokens: int
    block_n: int
    num_warps: int
    num_stages: int


def extend_tiles(num_heads: int, dtype: torch.dtype, *, fp8_cache: bool = False) -> ExtendTiles:
    """64-row tiles (two warpgroups of wgmma; see `decode_plan.default_launch`), heads first.

    fp32 (exact tests) uses 32-row tiles of 16 positions to keep the interpreter quick.
    An fp8 cache takes 16 positions a step and 2 stages (its widened tile costs
    registers; ~280 B still spill, see `decode_plan.default_launch`).
    """
    block_m = 32 if dtype == torch.float32 else 64
    heads_per_block = min(next_power_of_2(num_heads), block_m)
    return ExtendTiles(
        block_m=block_m,
        heads_per_block=heads_per_block,
        tokens=block_m // heads_per_block,
        block_n=16 if dtype == torch.float32 or fp8_cache else 32,
        num_warps=8 if block_m > 32 else 4,
        num_stages=2 if fp8_cache else 3,  # 3: prefetch page-table entries ahead of the cache tile (decode_plan)
    )


@register_kernel("mla", "extend", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES)
def mla_extend_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    kv_lora_rank: int,
    max_query_len: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[tokens, H, Dl+Dr]`; query_start `[rows + 1]`, seq_lens `[rows]`, page_table `[rows, max_pages]`.

    `max_query_len` sizes the grid; pass it (the executor knows it) to avoid a
    device-to-host read of query_start. Returns `[tokens, H, Dl]` in q's dtype.
    An fp8 e4m3 cache takes `kv_scale` (fp32 `[1]`; None: 1.0), see `reference`.
    """
    tokens, num_heads, width = q.shape
    rope = width - kv_lora_rank
    if cache.shape[2] != 1 or cache.shape[3] != width:
        raise ValueError(f"cache {tuple(cache.shape)} does not hold one latent+rope row of {width}")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("q and the cache must be contiguous along the last dim")
    out = torch.empty(tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    rows = seq_lens.shape[0]
    if tokens == 0 or rows == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max())
    scale_arg, _, has_scale, _ = kv_scale_args(kv_scale, kv_scale, cache, 1)
    f16_dots = cache.dtype == FP8_DTYPE and q.dtype == torch.bfloat16  # the dots' dtype: fp16 (tiles.py)
    tiles = extend_tiles(num_heads, q.dtype, fp8_cache=cache.dtype == FP8_DTYPE)
    token_blocks = max(1, -(-max_query_len // tiles.tokens))
    grid = (token_blocks, -(-num_heads // tiles.heads_per_block), rows)
    for_tensor(_mla_extend_kernel, q)[grid](
        q,
        cache,
        query_start,
        seq_lens,
        page_table,
        out,
        scale_arg,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        token_blocks,
        NUM_HEADS=num_heads,
        TOKENS=tiles.tokens,
        HEADS_PER_BLOCK=tiles.heads_per_block,
        KV_LORA=kv_lora_rank,
        ROPE=rope,
        PAGE_SIZE=cache.shape[1],
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_L=max(16, next_power_of_2(kv_lora_rank)),
        BLOCK_R=max(16, next_power_of_2(rope)),
        IEEE=q.dtype == torch.float32,
        HAS_SCALE=has_scale,
        F16_DOTS=f16_dots,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
