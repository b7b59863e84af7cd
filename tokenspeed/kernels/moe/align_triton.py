"""`align.align_by_expert` in one Triton program, for decode-sized batches.

The torch version is ~20 small kernels (count, sort, prefix sums, scatter,
searchsorted). A decode step replays them in every MoE layer, and at 1-64
tokens they cost as much as the expert GEMMs themselves (which then only
stream a few experts' weights). Here one program does it all:

1. histogram of expert ids -> per-expert counts, padded to BLOCK_M, prefix sums
   -> each expert's first padded row (kept in a small scratch buffer);
2. fill the pair ids with the padding value, and write each block's expert
   (the number of experts whose blocks end at or before it, -1 past the end);
3. rank of each pair among the earlier pairs of its expert (a chunked
   all-pairs comparison: O((T*k)^2), cheap below `ALIGN_TRITON_MAX_PAIRS`),
   so the placement is the stable order the torch version produces;
4. scatter each pair id to its expert's first row + rank.

Outputs are identical to `align.align_by_expert` (the tests compare them).
Programs of one CTA order their global writes with `tl.debug_barrier()`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.moe.align import BlockAlignment, max_blocks
from tokenspeed.kernels.triton_launch import for_tensor, next_power_of_2

# Largest T*k aligned by the single-program kernel; larger batches use the torch version.
ALIGN_TRITON_MAX_PAIRS = 1024
NUM_WARPS = 8
_REDUCTION_TILE = 8192  # elements of the block x expert and pair x chunk comparison tiles


def reduction_tiles(block_p: int, block_e: int) -> tuple[int, int]:
    """(BLOCK_B, CHUNK): blocks per block-expert pass and pairs per rank pass, ~8K elements each."""
    return max(1, min(64, _REDUCTION_TILE // block_e)), min(block_p, max(1, _REDUCTION_TILE // block_p))


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
    CHUNK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_P)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.histogram(ids, BLOCK_E, mask=ok)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(scratch_ptr + experts, ends - padded)
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
    rank = tl.zeros((BLOCK_P,), dtype=tl.int32)
    for j0 in range(0, num_pairs, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        other = tl.load(ids_ptr + j, mask=j < num_pairs, other=-1).to(tl.int32)
        earlier = (other[None, :] == ids[:, None]) & (j[None, :] < offs[:, None])
        rank += tl.sum(earlier.to(tl.int32), axis=1)
    first_row = tl.load(scratch_ptr + ids, mask=ok, other=0)
    tl.store(pair_ids_ptr + first_row + rank, offs, mask=ok)


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
        block_p = next_power_of_2(num_pairs)
        block_e = next_power_of_2(num_experts)
        block_b, chunk = reduction_tiles(block_p, block_e)
        scratch = torch.empty(block_e, dtype=torch.int32, device=device)
        for_tensor(_align_kernel, flat)[(1,)](
            flat.contiguous(), pair_ids, block_expert, scratch, num_pairs, blocks,
            NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=block_e,
            BLOCK_B=block_b, CHUNK=chunk, num_warps=NUM_WARPS,
        )  # fmt: skip
    return BlockAlignment(pair_ids=pair_ids, block_expert=block_expert, block_m=block_m)
