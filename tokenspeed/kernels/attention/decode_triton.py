"""Triton paged decode attention: one query token per row (or q_len, verifying drafts), split-KV.

Decode is bound by reading K/V, so the kernel is shaped around reading each
cached byte once:
- a program serves *all* query heads of one kv head (GQA/MQA), so K/V are
  loaded once per kv head rather than once per query head; the group (padded
  to 16, the smallest MMA tile) is the M side of `tl.dot`;
- one row's context is cut into `num_splits` ranges handled by separate
  programs, so a batch of a few long rows still fills every SM; a second small
  kernel merges the partial results through their log-sum-exp;
- everything per row (length, pages) is read from device tensors, and the
  grid depends only on (rows, heads, num_splits): the launch is a fixed shape
  that a CUDA graph can capture once per batch bucket and replay for any
  lengths. Rows of length 0 (batch padding) produce zeros;
- `attention.verify` (speculative decoding: the last token and k drafts
  per row, q_len = k+1, causal inside the row) is the same kernel with the
  row's tokens folded into the tile, as MLA decode folds them into its head
  axis: F tokens x the group's heads share one program (F the largest
  divisor of q_len with group x F <= 64), so the row's K/V is read once per
  F tokens, and the tile rows a lone token leaves empty (group 4 of 16) are
  used; each tile row masks keys past its own token;
- both kernels launch with programmatic dependent launch on Hopper
  (`kernels/pdl.py`): at short contexts they are latency-bound, and the
  launch of each overlaps the kernel before it.

FP8 KV cache (e4m3, per-head or per-tensor scales, `quant/fp8.kv_scale_layout`):
a program serves one kv head, so its key scale is folded into the softmax
scale and its value scale multiplies the output once, and the inner loop
gains no multiply. A tile is half the bytes, so fp8 caches take 128
positions a step (same bytes in flight as 64 bf16 positions). The dots run
in fp16 (`F16_DOTS`: a bf16 query is converted once, saturating at fp16's
range; probabilities are rounded to fp16, finer than bf16): e4m3 widens to
fp16 with one instruction per pair, to bf16 only through fp16 with a slow
conversion per value, and the value tile is widened in registers before
Triton transposes it for the dot (`fp8_cast.widen_fp8`). On the H200 the
first version (bf16 dots, values transposed byte by byte in shared memory)
ran at half the copy bandwidth, barely faster than a bf16 cache. Positions
per step, pipeline depth, register cap and page lookup of an fp8 cache are timed
per model shape on first use (`kernels/autotune.py`, `fp8_launch_candidates`),
on four long rows of the cache's own pages (`tuning_case`).
Uncapped, the fp8 kernel takes 160-168 registers, so three programs share an
SM against the bf16 kernel's five; Nsight Compute on an H200 saw it at 66%
of DRAM throughput (bf16: 90%) with no eligible warp 63% of cycles. Capped at
96 registers (64 positions, two stages; 32 B spilled) five fit, and the
Llama-3.1-8B decode step at 4 x 32K took 7.75-7.77 ms against 8.06 on an
H100 (`benchmarks/results/h100/wave2/fp8_2026-12-06g/`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.attention.decode_plan import (
    MAX_TILE_ROWS,
    SplitLaunch,
    choose_fold,
    choose_num_splits,
    fp8_launch_candidates,
    positions_per_step,
    tuning_case,
)
from tokenspeed.kernels.attention.paged_tiles import (
    dot,
    gather_kv_tile,
    merge_split_partials,
    online_softmax_step,
    store_split_partial,
)
from tokenspeed.kernels.autotune import LaunchTuner, TunedChoice
from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options, prefetch_rows_l2
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, kv_scale_args
from tokenspeed.kernels.quant.fp8_cast import to_f16_saturated, widen_fp8
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2

LOG2E = 1.4426950408889634
_LIST_PAGES = tl.constexpr(128)  # page ids a program holds in registers at once (`SplitLaunch.page_list`)


@triton.jit
def _fold_tile(q, k_cache_ptr, v_cache_ptr, page, pos, end, q_pos, window, scale_log2e, kv_head, stride_kp, stride_ks,
               stride_kh, stride_vp, stride_vs, stride_vh, offs_d, d_mask, m_i, l_i, acc, PAGE_SIZE: tl.constexpr,
               HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """One tile of positions `pos` (on pages `page`) into the split's online softmax: the query rows' scores
    against its keys, masked to the keys each row sees, and its values."""
    n_mask = pos < end
    slot = pos % PAGE_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = gather_kv_tile(k_cache_ptr, page, slot, kv_head, stride_kp, stride_ks, stride_kh, offs_d, kv_mask)
    scores = dot(q, tl.trans(widen_fp8(k, q.dtype, False)), IEEE)
    visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
    scores = tl.where(visible, scores * scale_log2e, float("-inf"))
    v = gather_kv_tile(v_cache_ptr, page, slot, kv_head, stride_vp, stride_vs, stride_vh, offs_d, kv_mask)
    return online_softmax_step(scores, widen_fp8(v, q.dtype, True), m_i, l_i, acc, IEEE)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2e,
    window,
    q_len,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    G_BLOCKS: tl.constexpr,
    T_GROUPS: tl.constexpr,
    FOLD: tl.constexpr,
    F16_DOTS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
    PAGE_LIST: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1) // (G_BLOCKS * T_GROUPS)
    t_group = tl.program_id(1) % (G_BLOCKS * T_GROUPS) // G_BLOCKS
    g_block = tl.program_id(1) % G_BLOCKS
    split = tl.program_id(2)

    # Tile rows: (query token j of the row, query head of this kv head). Unfolded, one token's heads
    # (in blocks of BLOCK_G); folded, FOLD consecutive tokens x all GROUP heads.
    offs_m = tl.arange(0, BLOCK_G)
    if FOLD == 1:
        offs_g = g_block * BLOCK_G + offs_m
        j = t_group + offs_m * 0
        m_mask = offs_g < GROUP
    else:
        offs_g = offs_m % GROUP
        j = t_group * FOLD + offs_m // GROUP
        m_mask = offs_m < FOLD * GROUP
    heads = kv_head * GROUP + offs_g
    seq_len = tl.load(seq_lens_ptr + row)
    token = (row * q_len + j).to(tl.int64)
    q_pos = seq_len - q_len + j  # each token sees keys 0 .. q_pos (and the last `window` of them)
    first_pos = seq_len - q_len + t_group * FOLD
    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos + 1 - window, 0)
    kv_end = tl.maximum(tl.minimum(first_pos + FOLD, seq_len), lo)  # keys past the tile's last token: unseen
    split_len = tl.cdiv(tl.cdiv(kv_end - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, kv_end)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    table = page_table_ptr + row.to(tl.int64) * stride_pt
    if USE_PDL:  # the row's length, pages and older keys and values are not the previous kernel's output (it
        # writes the step's new position): the first tile is asked of the L2 before the wait (kernels/pdl.py)
        pos = start + tl.arange(0, BLOCK_N)
        page = tl.load(table + pos // PAGE_SIZE, mask=pos < end, other=0).to(tl.int64)
        rows_k = page * stride_kp + (pos % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        rows_v = page * stride_vp + (pos % PAGE_SIZE) * stride_vs + kv_head * stride_vh
        prefetch_rows_l2(k_cache_ptr + rows_k, BLOCK_D * k_cache_ptr.dtype.element_ty.primitive_bitwidth // 8)
        prefetch_rows_l2(v_cache_ptr + rows_v, BLOCK_D * v_cache_ptr.dtype.element_ty.primitive_bitwidth // 8)
        gdc_wait()
        gdc_launch_dependents()
    q = tl.load(
        q_ptr + token[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if F16_DOTS:  # an fp8 cache under a bf16 query: the dots run in fp16 (module docstring)
        q = to_f16_saturated(q)

    if HAS_SCALE:  # fp8 keys: k = k_fp8 * k_scale, folded into the softmax scale
        scale_log2e = scale_log2e * tl.load(k_scale_ptr + kv_head * SCALE_STRIDE)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if PAGE_LIST:  # the chunk's page ids in registers: no load between a tile's address and the loop (SplitLaunch)
        CHUNK: tl.constexpr = (_LIST_PAGES - 1) * PAGE_SIZE // BLOCK_N * BLOCK_N  # whole tiles, any start
        offs_p = tl.arange(0, _LIST_PAGES)
        for chunk_start in range(start, end, CHUNK):
            chunk_end = tl.minimum(chunk_start + CHUNK, end)
            first_page = chunk_start // PAGE_SIZE
            pages = tl.load(table + first_page + offs_p, mask=offs_p <= (chunk_end - 1) // PAGE_SIZE - first_page,
                            other=0)  # fmt: skip
            for block_start in range(chunk_start, chunk_end, BLOCK_N):
                pos = block_start + tl.arange(0, BLOCK_N)
                listed = tl.minimum(pos // PAGE_SIZE - first_page, _LIST_PAGES - 1)  # masked positions: any page
                page = tl.gather(pages, listed, 0).to(tl.int64)
                m_i, l_i, acc = _fold_tile(q, k_cache_ptr, v_cache_ptr, page, pos, end, q_pos, window, scale_log2e,
                                           kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                                           offs_d, d_mask, m_i, l_i, acc, PAGE_SIZE, HAS_WINDOW, IEEE)  # fmt: skip
    else:
        for block_start in range(start, end, BLOCK_N):
            pos = block_start + tl.arange(0, BLOCK_N)
            page = tl.load(table + pos // PAGE_SIZE, mask=pos < end, other=0).to(tl.int64)
            m_i, l_i, acc = _fold_tile(q, k_cache_ptr, v_cache_ptr, page, pos, end, q_pos, window, scale_log2e,
                                       kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                                       offs_d, d_mask, m_i, l_i, acc, PAGE_SIZE, HAS_WINDOW, IEEE)  # fmt: skip
    if HAS_SCALE:
        acc = acc * tl.load(v_scale_ptr + kv_head * SCALE_STRIDE)

    if NUM_SPLITS == 1:
        result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        dst = out_ptr + token[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    else:
        part = (token * NUM_HEADS + heads) * NUM_SPLITS + split
        store_split_partial(part_out_ptr, part_lse_ptr, part, m_mask, acc, m_i, l_i, offs_d, d_mask, HEAD_DIM)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # see kernels/pdl.py: wait for the previous kernel before any access
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0)  # a row's query token (the row itself at one token per row)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    base = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    merged = merge_split_partials(part_out_ptr, part_lse_ptr, base, offs_s, s_mask, offs_d, d_mask, HEAD_DIM)
    dst = out_ptr + token.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


# Tuned once per model shape (not per batch or table width, which may change every eager step).
_FP8_TUNER: LaunchTuner[SplitLaunch] = LaunchTuner("attention.decode fp8 launch", fp8_launch_candidates)


def tuned_fp8_launches() -> dict[tuple[Any, ...], TunedChoice[SplitLaunch]]:
    """The launch each fp8-cache shape got (and the candidates' times), for benchmarks."""
    return _FP8_TUNER.chosen()


def _tuning_run(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
    *, q_len: int, num_splits: int, **kwargs: Any,
) -> Callable[[SplitLaunch], torch.Tensor]:
    """The fp8 launch tuner's run: a candidate on `tuning_case`, built at the first (untimed) run; on the
    call's own rows where the cache is too small for it."""
    cases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]] = []

    def run(launch: SplitLaunch) -> torch.Tensor:
        if not cases:
            case = tuning_case(q, k_cache, q_len)
            cases.append((*case, None) if case is not None else (q, page_table, seq_lens, num_splits))
        queries, table, lens, splits = cases[0]
        return _paged_decode(queries, k_cache, v_cache, table, lens, q_len=q_len, num_splits=splits, launch=launch,
                             **kwargs)  # fmt: skip

    return run


@register_kernel(
    "attention", "decode", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    launch: SplitLaunch | None = None,
) -> torch.Tensor:
    """q `[rows, heads, head_dim]` over caches `[num_pages, page_size, kv_heads, head_dim]`.

    page_table `[rows, max_pages]` and seq_lens `[rows]` are int32 or int64
    device tensors. `num_splits` None picks one from the table width (the most
    tokens a row can hold), which never reads the tensors' values. Caches in
    fp8 e4m3 take `k_scale` / `v_scale` (fp32 `[kv_heads]` or `[1]`; None: 1.0).
    `launch` None: the default for a bf16 cache, the tuned one for an fp8 cache.
    """
    return _paged_decode(q, k_cache, v_cache, page_table, seq_lens, q_len=1, scale=scale,
                         sliding_window=sliding_window, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
                         launch=launch)


@register_kernel(
    "attention", "verify", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def verify_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_len: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    fold: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q_len` query tokens per row (speculative verification: the last token and k drafts), q
    `[rows * q_len, heads, head_dim]`, at the last q_len of each row's `seq_lens` positions, causal.

    The decode kernel with the row's tokens folded into the tile (`choose_fold`; `fold=1` turns it
    off): one program reads the row's K/V once for F tokens. Launch shape depends only on (rows,
    q_len, heads, num_splits), so a verify batch of one q_len is CUDA-graph capturable.
    """
    return _paged_decode(q, k_cache, v_cache, page_table, seq_lens, q_len=q_len, scale=scale,
                         sliding_window=sliding_window, num_splits=num_splits, fold=fold, k_scale=k_scale,
                         v_scale=v_scale)


def _paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_len: int,
    scale: float,
    sliding_window: int | None,
    num_splits: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    fold: int | None = None,
    launch: SplitLaunch | None = None,
) -> torch.Tensor:
    tokens, num_heads, head_dim = q.shape
    rows = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} kv heads")
    if tokens != rows * q_len:
        raise ValueError(f"q has {tokens} tokens, expected rows * q_len = {rows} * {q_len}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the kv caches must be contiguous along head_dim")
    out = torch.empty_like(q)
    if rows == 0:
        return out
    group = num_heads // num_kv_heads
    fold = choose_fold(group, q_len) if fold is None else fold
    if q_len % fold or (fold > 1 and group * fold > MAX_TILE_ROWS):
        raise ValueError(f"fold {fold} must divide q_len {q_len} and keep group * fold <= {MAX_TILE_ROWS}")
    t_groups = q_len // fold
    if num_splits is None:
        num_splits = choose_num_splits(rows * t_groups, num_kv_heads, page_table.shape[1] * page_size, q.device)
    k_scale_arg, v_scale_arg, has_scale, scale_stride = kv_scale_args(k_scale, v_scale, k_cache, num_kv_heads)
    block_g = max(16, min(MAX_TILE_ROWS, next_power_of_2(group * fold)))
    g_blocks = -(-group // block_g) if fold == 1 else 1
    block_d = max(16, next_power_of_2(head_dim))
    if launch is None and k_cache.dtype == FP8_DTYPE and q.dtype != torch.float32:
        run = _tuning_run(
            q, k_cache, v_cache, page_table, seq_lens, q_len=q_len, num_splits=num_splits, scale=scale,
            sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, fold=fold,
        )  # fmt: skip
        key = (head_dim, num_heads, num_kv_heads, page_size, q.dtype, q_len, fold)
        launch = _FP8_TUNER.choose(key, q.device, run)
    launch = launch or SplitLaunch(positions_per_step(block_d, k_cache.element_size()), 2)
    pdl = pdl_enabled(q.device)
    if num_splits > 1:
        part_out = torch.empty(tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel when there is one split
    for_tensor(_decode_split_kernel, q)[(rows, num_kv_heads * g_blocks * t_groups, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        out,
        part_out,
        part_lse,
        k_scale_arg,
        v_scale_arg,
        scale * LOG2E,
        sliding_window or 0,
        q_len,
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
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits,
        G_BLOCKS=g_blocks,
        T_GROUPS=t_groups,
        FOLD=fold,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=launch.block_n,
        HAS_WINDOW=sliding_window is not None,
        IEEE=q.dtype == torch.float32,
        HAS_SCALE=has_scale,
        SCALE_STRIDE=scale_stride,
        F16_DOTS=k_cache.dtype == FP8_DTYPE and q.dtype == torch.bfloat16,
        PAGE_LIST=launch.page_list,
        num_warps=4,
        num_stages=launch.num_stages,
        **pdl_launch_options(pdl),
        **({"maxnreg": launch.max_registers} if launch.max_registers else {}),
    )
    if num_splits > 1:
        for_tensor(_decode_reduce_kernel, q)[(tokens, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
            **pdl_launch_options(pdl),
        )
    return out
