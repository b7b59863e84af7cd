"""Host-side planning of an MLA decode launch: q-head fold, head tiling, KV splits, tile sizes.

Kept apart from the kernel so the executor (CUDA-graph buckets), the
benchmark and the tests can ask what a launch will look like without
launching it. Everything here depends only on shapes, never on tensor values,
so a plan made at capture time holds for every replay.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from tokenspeed.kernels.triton_launch import next_power_of_2, sm_count_of

BLOCK_H = 64  # query rows per program on the GPU: one wgmma tile (m64) per warpgroup
# Short splits for short contexts: a program walks its split as a chain of dependent tiles
# (~1.7 us each on the H200), so at bs1 with 1K tokens 256-token splits left 5 programs of
# 8 tiles each (14.7 us per layer in the Moonlight profile); 64-token splits give 18 short ones.
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 128  # one 64K row of 16 heads: 128 programs of 512 tokens cover the 132 SMs
# Splits at least this long take the anchored softmax (measured: splits of <= 128 positions run
# faster online, of >= 512 anchored; see `default_launch`).
_ANCHORED_MIN_SPLIT_TOKENS = 512


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """Tile and pipeline sizes of the decode kernel (`block_n` cached positions per step) and its softmax form.

    `anchored` False is the online softmax (the off switch of the anchored one).
    """

    block_n: int
    num_warps: int
    num_stages: int
    anchored: bool = False


def fold_groups(q_len: int, fold: int) -> int:
    """Programs per row and head block: groups of `fold` query tokens, the last one possibly short."""
    return -(-q_len // fold)


def choose_fold(num_heads: int, q_len: int, block_h: int = BLOCK_H) -> int:
    """Query tokens folded into one program: as few programs per row as tiles of num_heads * F <= block_h
    rows allow, F balanced over them (16 heads: q_len 5 -> 3 + 2, not five unfolded programs); 1 when one
    token's heads fill the tile. F need not divide q_len: the last group is ragged (masked rows)."""
    widest = min(q_len, block_h // num_heads)
    if widest <= 1:
        return 1
    groups = fold_groups(q_len, widest)  # the fewest groups the tile allows
    return -(-q_len // groups)  # the tokens spread evenly over them


def head_tiling(num_heads: int, fold: int) -> tuple[int, int]:
    """(heads per program, head blocks): all heads when folding, else blocks of BLOCK_H heads."""
    heads_per_block = num_heads if fold > 1 else min(num_heads, BLOCK_H)
    return heads_per_block, -(-num_heads // heads_per_block)


def block_m_of(num_heads: int, fold: int) -> int:
    """Query rows of one program's tile: fold x heads per block, padded to a power of two >= 16 (MMA)."""
    return max(16, next_power_of_2(head_tiling(num_heads, fold)[0] * fold))


def default_launch(
    block_m: int, dtype: torch.dtype, split_tokens: int | None = None, *, fp8_cache: bool = False
) -> DecodeLaunch:
    """Sizes that compile for sm_90 (see compile_check), picked by measurement on the H200.

    `split_tokens` bounds the cached positions one program walks (the
    longest context the table allows / num_splits; None: long). Long splits
    of tiles up to 32 query rows take the anchored softmax (`tiles.
    _attend_anchored`): it keeps cross-warp reductions out of the loop and,
    with 64 positions per step, reads 16 heads x 64K tokens at 0.83 of the
    copy bandwidth against 0.68 for the online softmax. A program of a tile
    or two is bound by its latency instead, where the online softmax over
    32-position steps is a few µs faster (Moonlight bs1 at 1K tokens: 2.91
    against 3.01 ms per token); both sides are in
    `benchmarks/results/h200/mla_decode_launch_sweep.log`. 64-row tiles (128
    heads, or 16 heads x 4 folded tokens) run on wgmma, and there the
    anchored form measured 1.3x slower (its extra row tiles spill), so they
    stay online.
    Other sizes (bf16): 32- and 64-row tiles take 64 positions, 8 warps (the
    512-wide fp32 accumulator needs two warpgroups) and three stages. fp32
    (exact tests) uses 16 positions per step to fit.
    An fp8 cache is widened in registers (to fp16, `tiles.py`), which the
    bf16 path never needs (its tiles go straight to shared memory), so it
    takes 8 warps and 32 positions a step (16 for 64-row tiles): 16-row tiles
    then compile without spills and 64-row tiles with ~300 B (compile_check;
    the fp8 launches are not yet measured).
    """
    anchored = block_m <= 32 and (split_tokens is None or split_tokens >= _ANCHORED_MIN_SPLIT_TOKENS)
    if fp8_cache and dtype != torch.float32:
        if block_m <= 32:
            return DecodeLaunch(block_n=32, num_warps=8, num_stages=2, anchored=anchored)
        return DecodeLaunch(block_n=16, num_warps=8, num_stages=3)
    if dtype == torch.float32:
        return DecodeLaunch(block_n=16, num_warps=4 if block_m <= 16 else 8, num_stages=3, anchored=anchored)
    if block_m <= 16:
        if anchored:
            return DecodeLaunch(block_n=64, num_warps=4, num_stages=2, anchored=True)
        return DecodeLaunch(block_n=32, num_warps=4, num_stages=2)
    return DecodeLaunch(block_n=64, num_warps=8, num_stages=3, anchored=anchored)


def anchor_headroom(dtype: torch.dtype) -> float:
    """How far (base 2) a score may rise above its row's anchored shift before the range is walked again.

    exp2 of it must stay finite in the dtype P is multiplied in: fp16 tops out
    at 65504 (~2^16); bf16 shares fp32's exponent range, where fp32 row sums
    of 2^20 positions x 2^64 stay far from 2^128.
    """
    return 15.0 if dtype == torch.float16 else 64.0


def programs_per_sm(block_m: int) -> int:
    """Decode programs one SM holds at once: registers allow two 16-row tiles, one of anything larger."""
    return 2 if block_m <= 16 else 1


@functools.cache
def _fewest_waves_splits(programs: int, slots: int, limit: int) -> int:
    """The split count in [1, limit] with the least time in units of one unsplit row.

    With S splits the grid runs ceil(programs * S / slots) waves of programs
    doing 1/S of a row each. A grid just over one wave doubles the time (136
    programs on 132 SMs), so rather than `slots / programs` rounded up, take
    the count whose waves are fullest; a larger count must win by 5% to pay
    for its extra partials.
    """
    best, best_cost = 1, float(math.ceil(programs / slots))
    for splits in range(2, limit + 1):
        cost = math.ceil(programs * splits / slots) / splits
        if cost < 0.95 * best_cost:
            best, best_cost = splits, cost
    return best


def choose_num_splits(
    num_rows: int,
    num_heads: int,
    q_len: int,
    max_seq_len: int,
    *,
    fold: int | None = None,
    device: torch.device | str | None = None,
) -> int:
    """Splits per row that fill whole waves of resident programs, >= 64 tokens a split, at most 128.

    Each split costs a 2 KiB-per-query-row fp32 partial, written and merged
    (it stays in L2), hence the floor on split length and the cap. For CUDA
    graphs call it once per batch bucket with the longest context the pool
    allows (table width x page size); the extra splits of a shorter row exit
    at once. H200: 132 SMs.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    fold = choose_fold(num_heads, q_len) if fold is None else fold
    programs = max(1, num_rows * fold_groups(q_len, fold) * head_tiling(num_heads, fold)[1])
    slots = sm_count_of(torch.device(device)) * programs_per_sm(block_m_of(num_heads, fold))
    limit = max(1, min(max_seq_len // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS))
    return _fewest_waves_splits(programs, slots, limit)
