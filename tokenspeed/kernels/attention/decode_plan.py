"""Host-side planning of the paged decode kernel's launch (`decode_triton.py`): splits a row, query
tokens folded into a program, positions a loop step, and the fp8 cache's launch candidates with the
decode their tuner times. No kernels here: these decide the grid and constexprs before a launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed.kernels.triton_launch import next_power_of_2, sm_count_of

_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 64
MAX_TILE_ROWS = 64  # query rows of one program: a group's heads, times the tokens folded in
# The decode the fp8 launch tuner times (`tuning_case`): a few rows of a long context.
_TUNING_ROWS = 4
_TUNING_CONTEXT = 16384


def positions_per_step(block_d: int, cache_element_size: int) -> int:
    """Cached positions per loop step: 64 (32 for head dims over 128), doubled for 1-byte fp8 caches."""
    return (64 if block_d <= 128 else 32) * max(1, 2 // cache_element_size)


def choose_num_splits(
    num_rows: int, num_kv_heads: int, max_seq_len: int, device: torch.device | str | None = None
) -> int:
    """Splits per row: about 32 programs per SM, never under 128 tokens per split, at most 64.

    Many small programs rather than one wave of big ones: each SM holds ~4 of
    these programs at a time, and with only 1-3 waves the last, partly empty
    wave would cost up to a third of the bandwidth. The partial results cost
    little (4 bytes per head dim per split, against thousands of cached bytes).
    For CUDA graphs call it once per batch bucket with the longest context the
    pool allows: the extra splits of a short row are programs that exit at once.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    programs = max(1, num_rows * num_kv_heads)
    wanted = -(-32 * sm_count_of(torch.device(device)) // programs)
    by_length = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


@dataclass(frozen=True, slots=True)
class SplitLaunch:
    """How `_decode_split_kernel` is launched: cached positions a loop step, pipeline stages, a register
    cap (`maxnreg`; None: the compiler's choice) that lets more programs share an SM, and where a tile's
    page ids come from.

    The pipeline issues a tile's loads as many steps ahead as its addresses allow. Read from the page
    table inside the loop (`page_list` False), the addresses of a tile wait on a load of the step
    before, and the compiler keeps one K and one V tile in flight whatever the stages: an fp8 program
    then has half the bytes in flight of a bf16 one at the same positions. With `page_list`, a program
    reads up to 128 page ids of its split at once into registers and takes each tile's from there
    (`tl.gather`), so `num_stages` s keep s - 1 tiles in flight (shared memory grows a tile a stage:
    `compile_check`).
    """

    block_n: int
    num_stages: int
    max_registers: int | None = None
    page_list: bool = False


def fp8_launch_candidates(key: tuple[Any, ...]) -> list[SplitLaunch]:
    """Launches an fp8 cache may take (`LaunchTuner`; the first is the default): key = (head_dim, ...).

    The fourth, capped at 96 registers, fits five programs on an SM (module docstring), each with one
    tile (16 KB at 128 dims) in flight. The page-list launches (`SplitLaunch`) at 64 positions, capped
    at 96 registers too, keep two tiles in flight at three stages (55 KB of shared memory: four
    programs an SM, 128 KB in flight) and three at four stages (72 KB: three programs, 144 KB); on
    sm_90 the caps spill 32-48 bytes (`compile_check`). On an H100 the three-stage one read fastest at
    every row and split count timed (32 x 32K: 0.927 of copy against 0.892 for the fourth; 4 x 32K:
    0.727 against 0.684; `benchmarks/results/h100/wave2/fp8_page_list_2026-12-07/`).
    """
    per_step = positions_per_step(max(16, next_power_of_2(key[0])), 1)
    half = per_step // 2
    return [SplitLaunch(per_step, 2), SplitLaunch(per_step, 3), SplitLaunch(half, 3), SplitLaunch(half, 2, 96),
            SplitLaunch(half, 3, 96, page_list=True), SplitLaunch(half, 4, 96, page_list=True)]


def tuning_case(
    q: torch.Tensor, k_cache: torch.Tensor, q_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q, page_table, seq_lens) of the decode the fp8 launch tuner times: `_TUNING_ROWS` rows of up to
    `_TUNING_CONTEXT` positions on distinct pages of the cache itself, in shuffled order.

    The engine's first call of a shape is its CUDA-graph probe, rows one position long: timed there,
    every candidate is launch overhead, and the pick is noise. A few long rows are the agent's
    operating point and where the launches differ (the cache's contents do not change a launch's
    time, and the kernel only reads the cache). None where the cache holds too few pages for it.
    """
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    pages_per_row = min(_TUNING_CONTEXT // page_size, num_pages // _TUNING_ROWS)
    if pages_per_row * page_size < _MIN_TOKENS_PER_SPLIT:
        return None
    gen = torch.Generator(device=q.device).manual_seed(0)
    pages = torch.randperm(num_pages, generator=gen, device=q.device)[: _TUNING_ROWS * pages_per_row]
    table = pages.view(_TUNING_ROWS, pages_per_row).to(torch.int32)
    seq_lens = torch.full((_TUNING_ROWS,), pages_per_row * page_size, dtype=torch.int32, device=q.device)
    queries = torch.randn((_TUNING_ROWS * q_len, *q.shape[1:]), generator=gen, device=q.device).to(q.dtype)
    return queries, table, seq_lens


def choose_fold(group: int, q_len: int, block: int = MAX_TILE_ROWS) -> int:
    """Query tokens one program serves: the largest divisor F of q_len with group * F <= `block` rows.

    Folding reads a row's K/V once for F tokens instead of once per token, and
    the tile's rows (group x F, padded to 16 for the MMA) are mostly free: a
    decode tile of group 4 leaves 12 of its 16 rows empty.
    """
    return max(f for f in range(1, q_len + 1) if q_len % f == 0 and (f == 1 or group * f <= block))
