"""Triton MLA decode over the paged latent cache: split-KV, with q-head folding.

Decode reads each row's whole latent cache (576 values per position for
DeepSeek-V3) to produce a handful of query tokens, so the kernel is built to
load every cache byte once per step:
- all heads share the one latent "kv head", so a program serves a tile of
  BLOCK_M query rows (heads) against each loaded K/V tile;
- **q-head folding**: with q_len > 1 (speculative verification) the query
  tokens of a row are folded into the head axis: groups of F tokens with
  heads * F <= BLOCK_H (64, the wgmma tile height on sm_90), as few groups as
  that allows (`choose_fold`; the last group may be short, its missing rows
  masked), and one program runs F tokens x heads query rows, each token with
  its own causal bound (`seq_len - q_len + j`). Unfolded (fold=1), each token re-reads the
  cache; 16 heads x 4 tokens fill a 64-row tile that 16 heads alone leave
  three-quarters empty. `fold=1` stays selectable for comparison;
- split-KV (flash-decoding): a row's context is cut into `num_splits` ranges
  handled by separate programs so a few long rows still fill all SMs, and a
  second kernel merges the partial (max, sum, output) through the log-sum-exp;
  one split (short contexts or big batches) stores the output directly;
- long splits of narrow tiles (16 or 32 query rows) take the *anchored*
  softmax (`tiles`): one exponent shift per row fixed at the first tile, so
  no cross-warp row max or row sum in the loop (0.68 -> 0.85 of the copy
  rate at 16 heads x 64K); `DecodeLaunch.anchored` False is its off switch;
- the grid depends only on (rows, q_len, heads, num_splits) and all per-row
  data is read on the device, so the launch is CUDA-graph capturable.
  Rows of length 0 (batch padding) yield zeros;
- an fp8 e4m3 cache (half the bytes to stream) is widened as its tiles load,
  to fp16 under a bf16 query (`F16_DOTS`: the query converted once,
  saturating; the anchored softmax then keeps fp16's headroom); its one
  scale is folded into the softmax scale and the output, so the loop gains
  no multiply.

Grid axis 0 is (query-token group, head block) so programs sharing a row's
cache run side by side and meet in L2; axis 2 is the split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.attention.paged_tiles import merge_split_partials, store_split_partial
from tokenspeed.kernels.mla.decode_plan import (
    BLOCK_H,
    DecodeLaunch,
    anchor_headroom,
    block_m_of,
    choose_fold,
    choose_num_splits,
    default_launch,
    fold_groups,
    head_tiling,
)
from tokenspeed.kernels.mla.tiles import attend_latent_range, load_query_tile, store_latent_output
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, kv_scale_args
from tokenspeed.kernels.quant.fp8_cast import to_f16_saturated
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2

LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    kv_scale_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_pt,
    stride_ot,
    stride_oh,
    q_len,
    num_splits,
    NUM_HEADS: tl.constexpr,
    FOLD: tl.constexpr,
    HEADS_PER_BLOCK: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ANCHORED: tl.constexpr,
    HEADROOM: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    F16_DOTS: tl.constexpr,
):
    head_block = tl.program_id(0) % HEAD_BLOCKS
    group = tl.program_id(0) // HEAD_BLOCKS  # FOLD consecutive query tokens of the row
    row = tl.program_id(1)
    split = tl.program_id(2)

    offs_m = tl.arange(0, BLOCK_M)
    j = group * FOLD + offs_m // HEADS_PER_BLOCK  # query token within the row
    head = head_block * HEADS_PER_BLOCK + offs_m % HEADS_PER_BLOCK
    m_mask = (offs_m < FOLD * HEADS_PER_BLOCK) & (head < NUM_HEADS) & (j < q_len)  # a ragged last group
    token = row * q_len + j
    seq_len = tl.load(seq_lens_ptr + row)
    q_pos = seq_len - q_len + j
    # Keys past the group's last token are seen by nobody in this program.
    kv_end = tl.maximum(tl.minimum(seq_len - q_len + (group + 1) * FOLD, seq_len), 0)
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_end)

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
        start,
        end,
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
        ANCHORED,
        HEADROOM,
    )
    if HAS_SCALE:  # and into the output (the value is the same latent)
        acc = acc * tl.load(kv_scale_ptr)
    if not SPLIT:
        store_latent_output(out_ptr, token, head, m_mask, acc, l_i, stride_ot, stride_oh, KV_LORA, BLOCK_L)
    else:
        offs_l = tl.arange(0, BLOCK_L)
        part = (token.to(tl.int64) * NUM_HEADS + head) * num_splits + split
        store_split_partial(
            part_out_ptr, part_lse_ptr, part, m_mask, acc, m_i, l_i, offs_l, offs_l < KV_LORA, KV_LORA
        )


@triton.jit
def _mla_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    KV_LORA: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (token, head, BLOCK_D slice of the latent): weight each split's output by exp2(lse - max lse).

    The latent is cut in slices across programs so all splits load at once
    without a `[splits, 512]` register tile, and small batches still spread.
    """
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < KV_LORA
    base = (token.to(tl.int64) * NUM_HEADS + head) * num_splits
    merged = merge_split_partials(part_out_ptr, part_lse_ptr, base, offs_s, s_mask, offs_d, d_mask, KV_LORA)
    dst = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


@register_kernel("mla", "decode", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES)
def mla_decode_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_len: int,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    fold: int | None = None,
    launch: DecodeLaunch | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[rows * q_len, H, Dl+Dr]` over cache `[num_pages, page_size, 1, Dl+Dr]` -> `[rows * q_len, H, Dl]`.

    page_table `[rows, max_pages]` and seq_lens `[rows]` are int32/int64 device
    tensors. `num_splits` None picks one from the table width (never reads
    tensor values); `fold` None picks `choose_fold(H, q_len)`, 1 disables folding;
    `launch` None takes `default_launch` for the table's longest context (the benchmark passes others to tune).
    An fp8 e4m3 cache takes `kv_scale` (fp32 `[1]`; None: 1.0), see `reference`.
    """
    tokens, num_heads, width = q.shape
    rows = seq_lens.shape[0]
    rope = width - kv_lora_rank
    if tokens != rows * q_len:
        raise ValueError(f"q has {tokens} tokens, expected rows * q_len = {rows} * {q_len}")
    if cache.shape[2] != 1 or cache.shape[3] != width:
        raise ValueError(f"cache {tuple(cache.shape)} does not hold one latent+rope row of {width}")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("q and the cache must be contiguous along the last dim")
    fold = choose_fold(num_heads, q_len) if fold is None else fold
    if fold < 1 or fold > q_len or (fold > 1 and num_heads * fold > BLOCK_H):
        raise ValueError(f"fold {fold} must lie in 1..q_len ({q_len}) and keep heads * fold <= {BLOCK_H}")
    out = torch.empty(tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    page_size = cache.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(
            rows, num_heads, q_len, page_table.shape[1] * page_size, fold=fold, device=q.device
        )
    scale_arg, _, has_scale, _ = kv_scale_args(kv_scale, kv_scale, cache, 1)
    f16_dots = cache.dtype == FP8_DTYPE and q.dtype == torch.bfloat16  # the dots' dtype: fp16 (tiles.py)
    heads_per_block, head_blocks = head_tiling(num_heads, fold)
    block_m = block_m_of(num_heads, fold)
    split_tokens = page_table.shape[1] * page_size // num_splits
    launch = launch or default_launch(block_m, q.dtype, split_tokens, fp8_cache=cache.dtype == FP8_DTYPE)
    block_l = max(16, next_power_of_2(kv_lora_rank))
    ieee = q.dtype == torch.float32
    if num_splits > 1:
        part_out = torch.empty(
            tokens, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel when there is one split
    grid = (fold_groups(q_len, fold) * head_blocks, rows, num_splits)
    for_tensor(_mla_decode_kernel, q)[grid](
        q,
        cache,
        page_table,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale_arg,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        q_len,
        num_splits,
        NUM_HEADS=num_heads,
        FOLD=fold,
        HEADS_PER_BLOCK=heads_per_block,
        HEAD_BLOCKS=head_blocks,
        KV_LORA=kv_lora_rank,
        ROPE=rope,
        PAGE_SIZE=page_size,
        SPLIT=num_splits > 1,
        BLOCK_M=block_m,
        BLOCK_N=launch.block_n,
        BLOCK_L=block_l,
        BLOCK_R=max(16, next_power_of_2(rope)),
        ANCHORED=launch.anchored,
        HEADROOM=anchor_headroom(torch.float16 if f16_dots else q.dtype),
        IEEE=ieee,
        HAS_SCALE=has_scale,
        F16_DOTS=f16_dots,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if num_splits > 1:
        block_d = min(128, block_l, 8192 // next_power_of_2(num_splits))  # <= 64 fp32 registers a thread
        for_tensor(_mla_merge_kernel, q)[(tokens, num_heads, block_l // block_d)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_HEADS=num_heads,
            KV_LORA=kv_lora_rank,
            BLOCK_S=next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
