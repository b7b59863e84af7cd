"""Group (token, k) pairs by expert, on the device, without a host sync.

Both fast `moe.experts` kernels run one GEMM per expert over the tokens routed
to it, so the T*k (token, slot) pairs must first be sorted by expert. Pair p
is token p // k, slot p % k (the row-major position in `topk_ids`).

`sort_by_expert` gives the expert-sorted pair order and each expert's end
offset (what `torch._grouped_mm` takes). `align_by_expert` also pads every
expert's run of pairs to a multiple of `block_m` rows, so that each row block
of the Triton grouped GEMM belongs to exactly one expert, and returns
`block_expert[b]` (-1 for the unused tail blocks).

The number of blocks is bounded from shapes alone, T*k/block_m + min(E, T*k)
(each expert wastes at most one partial block), so every output has a size
known on the host, nothing waits for the device (no `.item()`, no
`nonzero`, no `bincount`, which reads its maximum back on CUDA), and the step
can be captured in a CUDA graph. Counting uses `scatter_add_`, placement a
stable sort, so equal experts keep pair order and results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpertOrder:
    """Pairs sorted by expert: `order[i]` is the i-th pair; expert e owns sorted rows [ends[e-1], ends[e])."""

    order: torch.Tensor  # int64 [T*k], pair ids sorted by expert (stable)
    sorted_experts: torch.Tensor  # int64 [T*k], expert of each sorted row
    counts: torch.Tensor  # int64 [E], pairs routed to each expert
    ends: torch.Tensor  # int64 [E], inclusive cumulative counts


@dataclass(frozen=True, slots=True)
class BlockAlignment:
    """Pairs placed in per-expert runs padded to `block_m` rows (padding rows hold the pair id T*k)."""

    pair_ids: torch.Tensor  # int32 [num_blocks * block_m]
    block_expert: torch.Tensor  # int32 [num_blocks]; -1 where the block is unused
    block_m: int

    @property
    def num_blocks(self) -> int:
        return int(self.block_expert.shape[0])


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the padded row blocks: full blocks plus one partial block per used expert."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """Expert-sorted pair order and per-expert counts of `topk_ids` [T, k] (ids in [0, E))."""
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    sorted_experts, order = torch.sort(flat, stable=True)
    return ExpertOrder(order=order, sorted_experts=sorted_experts, counts=counts, ends=counts.cumsum(0))


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """Pad each expert's pairs to whole `block_m`-row blocks; see the module docstring."""
    grouped = sort_by_expert(topk_ids, num_experts)
    num_pairs = grouped.order.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    device = grouped.order.device
    padded = (grouped.counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    rank = torch.arange(num_pairs, device=device) - (grouped.ends - grouped.counts)[grouped.sorted_experts]
    dest = (padded_ends - padded)[grouped.sorted_experts] + rank
    pair_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids.scatter_(0, dest, grouped.order.to(torch.int32))
    block_ends = padded_ends // block_m
    block_index = torch.arange(blocks, device=device, dtype=block_ends.dtype)
    block_expert = torch.searchsorted(block_ends, block_index, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return BlockAlignment(pair_ids=pair_ids, block_expert=block_expert, block_m=block_m)
