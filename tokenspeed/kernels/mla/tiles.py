"""Triton building blocks shared by the MLA decode and extend kernels.

Both stream one row's latent cache through its page table, BLOCK_N positions
at a time, for a tile of BLOCK_M query rows (any mix of query tokens and
heads: all heads share the one latent "kv head"). A cached position is 576
values for DeepSeek-V3: 512 latent + 64 rope. `tl.dot` wants power-of-two
sizes, so the score is two dots (latent part, rope part), and the value tile
is the latent part of the *same* loaded tile: each cache byte is loaded once
and used for both the scores and the output. Causality is a per-query-row
bound (`q_pos`), which covers decode, folded speculative tokens and prefill
chunks alike. `@triton.jit` helpers are inlined, so sharing costs nothing.
An fp8 cache's tiles are widened to the query dtype as they are loaded (the
cache scale is the callers': folded into `scale_log2e` and the output); the
callers hand a bf16 query over as fp16 for an fp8 cache, so the widening is
one instruction per pair and the value tile is transposed as fp16
(`fp8_cast.widen_fp8`, as in the paged attention kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed.kernels.attention.paged_tiles import dot, online_softmax_step
from tokenspeed.kernels.quant.fp8_cast import widen_fp8


@triton.jit
def load_query_tile(
    q_ptr,
    token,
    head,
    m_mask,
    stride_qt,
    stride_qh,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """(latent part `[BLOCK_M, BLOCK_L]`, rope part `[BLOCK_M, BLOCK_R]`) of the query rows; masked rows are 0."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    base = q_ptr + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(base + offs_l[None, :], mask=m_mask[:, None] & (offs_l < KV_LORA)[None, :], other=0.0)
    q_rope = tl.load(
        base + KV_LORA + offs_r[None, :], mask=m_mask[:, None] & (offs_r < ROPE)[None, :], other=0.0
    )
    return q_lat, q_rope


@triton.jit
def attend_latent_range(
    q_lat,
    q_rope,
    q_pos,
    cache_ptr,
    table_ptr,
    lo,
    hi,
    scale_log2e,
    stride_cp,
    stride_cs,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
    ANCHORED: tl.constexpr = False,
    HEADROOM: tl.constexpr = 64.0,
):
    """Softmax of the query tile over cached positions [lo, hi) of one row; query row m sees pos <= q_pos[m].

    Online (running max and sum per tile), or with `ANCHORED` the anchored
    form (`_attend_anchored`; `HEADROOM` from `decode_plan.anchor_headroom`).
    Returns (the row's exponent shift in base 2, the sum, unnormalised
    `[BLOCK_M, BLOCK_L]` fp32 output).
    """
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    if ANCHORED:
        m_i, l_i, acc = _attend_anchored(
            q_lat, q_rope, q_pos, cache_ptr, table_ptr, lo, hi, scale_log2e, stride_cp, stride_cs, offs_l, offs_r,
            KV_LORA, ROPE, PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_L, HEADROOM, IEEE,
        )  # fmt: skip
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
        for block_start in range(lo, hi, BLOCK_N):
            scores, latent = _latent_scores(
                q_lat, q_rope, q_pos, cache_ptr, table_ptr, block_start, hi, scale_log2e, stride_cp, stride_cs,
                offs_l, offs_r, KV_LORA, ROPE, PAGE_SIZE, BLOCK_N, IEEE,
            )  # fmt: skip
            m_i, l_i, acc = online_softmax_step(scores, latent, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def store_latent_output(
    out_ptr, token, head, m_mask, acc, l_i, stride_ot, stride_oh, KV_LORA: tl.constexpr, BLOCK_L: tl.constexpr
):
    """Normalise and store `[BLOCK_M, KV_LORA]`; a query row that saw no key stores zeros."""
    offs_l = tl.arange(0, BLOCK_L)
    result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    dst = out_ptr + token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :]
    tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_l < KV_LORA)[None, :])


@triton.jit
def _latent_scores(
    q_lat,
    q_rope,
    q_pos,
    cache_ptr,
    table_ptr,
    block_start,
    hi,
    scale_log2e,
    stride_cp,
    stride_cs,
    offs_l,
    offs_r,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """(base-2 scores `[BLOCK_M, BLOCK_N]`, -inf where not visible; the latent tile) of positions block_start.."""
    pos = block_start + tl.arange(0, BLOCK_N)
    n_mask = pos < hi
    page = tl.load(table_ptr + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    rows = cache_ptr + page * stride_cp + (pos % PAGE_SIZE) * stride_cs
    latent = tl.load(
        rows[:, None] + offs_l[None, :], mask=n_mask[:, None] & (offs_l < KV_LORA)[None, :], other=0.0
    )
    latent = widen_fp8(latent, q_lat.dtype, True)  # also the value tile: used transposed in P V
    rope = tl.load(
        rows[:, None] + KV_LORA + offs_r[None, :], mask=n_mask[:, None] & (offs_r < ROPE)[None, :], other=0.0
    )
    rope = widen_fp8(rope, q_rope.dtype, False)
    scores = dot(q_lat, tl.trans(latent), IEEE) + dot(q_rope, tl.trans(rope), IEEE)
    visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
    return tl.where(visible, scores * scale_log2e, float("-inf")), latent


@triton.jit
def _attend_anchored(
    q_lat,
    q_rope,
    q_pos,
    cache_ptr,
    table_ptr,
    lo,
    hi,
    scale_log2e,
    stride_cp,
    stride_cs,
    offs_l,
    offs_r,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    HEADROOM: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The softmax without a row max or row sum per tile: each row's exponent shift is fixed up front.

    Why: with 16 query rows the MMA tiles spread a score row over all warps,
    so the online softmax's per-tile row max and row sum are cross-warp
    reductions, each a shared-memory round trip and a barrier on the loop's
    critical path (about a fifth of the kernel's time on the H200).
    Softmax needs one common shift per row, not the running max: any shift
    that keeps exp2(score - shift) finite gives the same result. So the
    first tile's row max is the shift (the *anchor*) for the whole range,
    the row sums accumulate elementwise and are reduced once at the end, and
    only the P layout change stays in the loop.
    Every row's largest shifted score is tracked on the way: it is >= 0 when
    the row sees anything (visibility is a prefix of the range, so a row
    seeing any key sees the first tile's). If it exceeds `HEADROOM` (a later
    score far above the first tile's: rare with real logits, but possible)
    the range is walked once more with that row's exact max as its anchor,
    which then fits. So tame data costs one pass and no input can overflow.
    Same returns as `attend_latent_range`.
    """
    anchor = tl.zeros([BLOCK_M], dtype=tl.float32)
    sums = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # typed before the loop that reassigns them
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    passes = 0
    redo = 1
    while redo > 0:
        sums = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        peak = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
        for block_start in range(lo, hi, BLOCK_N):
            scores, latent = _latent_scores(
                q_lat, q_rope, q_pos, cache_ptr, table_ptr, block_start, hi, scale_log2e, stride_cp, stride_cs,
                offs_l, offs_r, KV_LORA, ROPE, PAGE_SIZE, BLOCK_N, IEEE,
            )  # fmt: skip
            if (block_start == lo) & (passes == 0):
                first = tl.max(scores, 1)
                anchor = tl.where(first == float("-inf"), 0.0, first)
            shifted = scores - anchor[:, None]
            peak = tl.maximum(peak, shifted)
            p = tl.exp2(shifted)
            sums += p
            acc += dot(p.to(latent.dtype), latent, IEEE)
        row_peak = tl.max(peak, 1)
        outside = row_peak > HEADROOM
        anchor = tl.where(outside, anchor + row_peak, anchor)
        redo = tl.max(outside.to(tl.int32), 0)
        passes += 1
    return anchor, tl.sum(sums, 1), acc
