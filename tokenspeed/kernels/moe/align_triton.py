"""`align.align_by_expert` in one Triton program, for decode-sized batches.

The torch version is ~20 small kernels (count, sort, prefix sums, scatter,
searchsorted). A decode step replays them in every MoE layer, and at 1-64
tokens they cost as much as the expert GEMMs themselves (which then only
stream a few experts' weights). Here one program does it all:

1. histogram of expert ids -> per-expert counts, padded to BLOCK_M, prefix sums
   -> each expert's first padded row, less its first position among the pairs
   sorted by expert (kept in a small scratch buffer);
2. fill the pair ids with the padding value, and write each block's expert
   (the number of experts whose blocks end at or before it, -1 past the end);
3. sort the keys expert * BLOCK_P + pair in registers (`tl.sort`, bitonic:
   O(P log^2 P) compare-swaps spread over the program's threads); a pair's
   sorted position less its expert's first position is its rank among the
   earlier pairs of its expert, so the placement is the stable order the
   torch version produces;
4. scatter each pair id to its sorted position + the scratch shift.
The first version ranked the pairs by comparing all of them with all
(O(P^2) in chunks, one dependent load and reduction per chunk): 32 us a
layer at 64 tokens x top-8 on an H100, 9% of a Qwen3-30B-A3B FP8 bs64
step (`benchmarks/results/h100/wave2/moe_decode_tiles_2026-12-06/call1/`,
`e2e_base.qwen3_moe_bs64.profile.txt`). The sort takes 6.6 us there (the
step's steady wall 16.46 -> 15.23 ms) and stays under the torch version's
time up to 4096 pairs, 79 against 100 us
(`benchmarks/results/h100/wave2/moe_align_sort_2026-12-06/`), where the
single program's bound now lies (the all-pairs rank stopped at 1024).

Outputs are identical to `align.align_by_expert` (the tests compare them).
Programs of one CTA order their global writes with `tl.debug_barrier()`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.moe.align import BlockAlignment, max_blocks
from tokenspeed.kernels.triton_launch import for_tensor, next_power_of_2

# Largest T*k aligned by the single-program kernel (4096 pairs: 151 registers a thread, no spills, still faster
# than the torch version on an H100, module docstring); larger batches use the torch version (~20 launches).
ALIGN_TRITON_MAX_PAIRS = 4096
NUM_WARPS = 8
_REDUCTION_TILE = 8192  # elements of the block x expert comparison tile


def blocks_per_pass(block_e: int) -> int:
    """Blocks per pass of the block -> expert step: a [BLOCK_B, BLOCK_E] tile of ~8K elements."""
    return max(1, min(64, _REDUCTION_TILE // block_e))


def pairs_block(num_pairs: int) -> int:
    """BLOCK_P: the pairs as a power of two, at least 2 (`tl.sort` needs one compare-swap stage)."""
    return max(2, next_power_of_2(num_pairs))


@triton.jit
def _align_kernel(
    ids_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    scratch_ptr,
    num_pairs,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_P)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.histogram(ids, BLOCK_E, mask=ok)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(scratch_ptr + experts, (ends - padded) - (tl.cumsum(counts, 0) - counts))
    rows = num_blocks * BLOCK_M
    for start in range(0, rows, BLOCK_P):
        tl.store(pair_ids_ptr + start + offs, num_pairs, mask=start + offs < rows)
    block_ends = ends // BLOCK_M
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        done = (block_ends[None, :] <= blocks[:, None]) & (experts[None, :] < NUM_EXPERTS)
        expert = tl.sum(done.to(tl.int32), axis=1)
        expert = tl.where(expert < NUM_EXPERTS, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)
    tl.debug_barrier()
    keys = tl.sort(tl.where(ok, ids * BLOCK_P + offs, NUM_EXPERTS * BLOCK_P))  # padding lanes sort last
    shift = tl.load(scratch_ptr + keys // BLOCK_P, mask=ok, other=0)  # ok: the first num_pairs sorted lanes
    tl.store(pair_ids_ptr + offs + shift, keys % BLOCK_P, mask=ok)


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """Same result as `align.align_by_expert`, in one launch; T*k must be <= ALIGN_TRITON_MAX_PAIRS."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    if num_pairs > ALIGN_TRITON_MAX_PAIRS:
        raise ValueError(f"{num_pairs} pairs exceed ALIGN_TRITON_MAX_PAIRS={ALIGN_TRITON_MAX_PAIRS}")
    blocks = max_blocks(num_pairs, num_experts, block_m)
    device = flat.device
    pair_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    if num_pairs:
        block_e = next_power_of_2(num_experts)
        scratch = torch.empty(block_e, dtype=torch.int32, device=device)
        for_tensor(_align_kernel, flat)[(1,)](
            flat.contiguous(), pair_ids, block_expert, scratch, num_pairs, blocks,
            NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_P=pairs_block(num_pairs), BLOCK_E=block_e,
            BLOCK_B=blocks_per_pass(block_e), num_warps=NUM_WARPS,
        )  # fmt: skip
    return BlockAlignment(pair_ids=pair_ids, block_expert=block_expert, block_m=block_m)
