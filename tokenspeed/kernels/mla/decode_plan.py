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
# Short splits for short contexts: a program walks its split as a chain of dependent 32-position
# tiles (~1.7 us each on the H200), so at bs1 with 1K tokens 256-token splits left 5 programs of
# 8 tiles each (14.7 us per layer in the Moonlight profile); 64-token splits give 18 of 2 tiles.
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 128  # one 64K row of 16 heads: 128 programs of 512 tokens cover the 132 SMs


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """Tile and pipeline sizes of the decode kernel (`block_n` cached positions per step)."""

    block_n: int
    num_warps: int
    num_stages: int


def choose_fold(num_heads: int, q_len: int, block_h: int = BLOCK_H) -> int:
    """The largest divisor F of q_len with num_heads * F <= block_h (1 when one token's heads fill the tile)."""
    return max(f for f in range(1, q_len + 1) if q_len % f == 0 and (f == 1 or num_heads * f <= block_h))


def head_tiling(num_heads: int, fold: int) -> tuple[int, int]:
    """(heads per program, head blocks): all heads when folding, else blocks of BLOCK_H heads."""
    heads_per_block = num_heads if fold > 1 else min(num_heads, BLOCK_H)
    return heads_per_block, -(-num_heads // heads_per_block)


def block_m_of(num_heads: int, fold: int) -> int:
    """Query rows of one program's tile: fold x heads per block, padded to a power of two >= 16 (MMA)."""
    return max(16, next_power_of_2(head_tiling(num_heads, fold)[0] * fold))


def default_launch(block_m: int, dtype: torch.dtype) -> DecodeLaunch:
    """Sizes that compile for sm_90 without register spills (see compile_check), picked by measurement.

    The fp32 accumulator is block_m x 512: a 64-row tile needs two warpgroups
    (8 warps, one wgmma m64 each), as does a 32-row one (4 warps spill); a
    16-row tile fits 4 warps and leaves room for two programs per SM. The
    launch sweep of `benchmarks/mla_kernels.py --sweep` on the H200 (bf16, 16
    heads) chose the rest: 16-row tiles (q_len 1) are fastest with 32 cached
    positions per step and two stages (2% ahead of three; 16 positions or 8
    warps lose 40%+), folded 32/64-row tiles with 64 positions per step and
    three stages (1.25x faster than 32 at q_len 4). fp32 (exact tests) uses
    16 positions per step to fit.
    """
    if dtype == torch.float32:
        return DecodeLaunch(block_n=16, num_warps=4 if block_m <= 16 else 8, num_stages=3)
    if block_m <= 16:
        return DecodeLaunch(block_n=32, num_warps=4, num_stages=2)
    return DecodeLaunch(block_n=64, num_warps=8, num_stages=3)


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
    programs = max(1, num_rows * (q_len // fold) * head_tiling(num_heads, fold)[1])
    slots = sm_count_of(torch.device(device)) * programs_per_sm(block_m_of(num_heads, fold))
    limit = max(1, min(max_seq_len // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS))
    return _fewest_waves_splits(programs, slots, limit)
