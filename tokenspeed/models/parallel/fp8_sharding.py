"""FP8 weights split over ranks: which block scales a rank reads, and the whole rows' amax for online quantisation.

A block-FP8 checkpoint (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8) scales each
`bn x bk` block of a weight with one `weight_scale_inv` entry. A rank holding
rows (or input columns) `[s, e)` of the weight reads the scales of the blocks
those rows fall in, and its layer sees them as its own blocks: that holds when
its range starts on a block boundary, or lies inside one block (tiny models,
one kv head replicated). A range that starts inside a block and runs past it
(Qwen3-30B-A3B's 768-row experts over 4 ranks: 192 rows each, blocks of 128)
would need scales the checkpoint does not have; it is refused before any rank
starts (`check_fp8_sharding`), naming the tensor and what would fit.

Online quantisation (`quantization="fp8"`) scales each output row by its
amax. A rank holding part of every row (`o_proj`, `down_proj`, experts' `w2`
split by their input features) takes the max over the ranks that hold the
other parts (`amax_reducer`), so every rank quantises exactly as one rank
would: the same fp8 codes, the same scales.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenspeed.kernels.quant.fp8 import BlockSize
from tokenspeed.layers.fp8_weights import AmaxReduce
from tokenspeed.models.parallel.weight_inventory import checkpoint_tensors
from tokenspeed.models.parallel.weight_sharding import (
    ShardRule,
    TensorSlice,
    WeightKind,
    WeightShardingError,
    rule_for,
    slice_for_rank,
)
from tokenspeed.placement.collectives import all_gather
from tokenspeed.placement.parallel_config import Topology
from tokenspeed.placement.process_groups import ParallelGroups

if TYPE_CHECKING:
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.quant_config import Fp8Config


def scale_slice(weight_name: str, part: TensorSlice, weight_shape: tuple[int, ...], block: BlockSize) -> TensorSlice:
    """The scales of `part` of a 2-D `weight_shape` weight in `block` blocks, as the rank's own blocks.

    WeightShardingError when the part starts inside a block and runs past its end.
    """
    if part.dim is None:
        return part
    size = min(block[part.dim], weight_shape[part.dim])  # a block larger than the weight is clipped to it
    first, last = part.start // size, (part.stop - 1) // size
    if part.start % size and last > first:
        axis = "rows" if part.dim == 0 else "input columns"
        fix = f"a tensor_parallel_size that splits its {weight_shape[part.dim]} {axis} into multiples of {size}"
        if ".experts." in weight_name:
            fix = f"enable_expert_parallel (whole experts on each rank), or {fix}"
        raise WeightShardingError(
            f"{weight_name}: a rank's {axis} [{part.start}, {part.stop}) start inside a {size}-{axis[:-1]} FP8 "
            f"block and run past it, so no weight_scale_inv entry covers them alone; use {fix}"
        )
    return TensorSlice(part.dim, first, last + 1)


def check_fp8_sharding(config: ModelConfig, fp8: Fp8Config | None, topology: Topology) -> None:
    """Refuse, before any rank starts, a block-FP8 checkpoint whose blocks a rank's share would cut."""
    if fp8 is None or fp8.block_size is None or topology.world_size == 1:
        return
    checked: set[tuple[int | None, int, int, tuple[int, ...]]] = set()  # (dim, start, stop, shape)
    for tensor in checkpoint_tensors(config):
        if not fp8.stores_fp8(tensor.name):
            continue
        rule = rule_for(tensor.name, config, topology)
        if not rule.sharded:
            continue
        for rank in _ranks_to_check(rule, topology):
            part = slice_for_rank(tensor.name, rule, tensor.shape, topology, rank)
            if part is None or (part.dim, part.start, part.stop, tensor.shape) in checked:
                continue
            scale_slice(tensor.name, part, tensor.shape, fp8.block_size)
            checked.add((part.dim, part.start, part.stop, tensor.shape))


def _ranks_to_check(rule: ShardRule, topology: Topology) -> range:
    """Every rank; for an expert, the ranks of one EP group (the others hold other experts, split alike)."""
    if rule.kind in (WeightKind.EXPERT_COLUMN, WeightKind.EXPERT_ROW):
        assert rule.expert is not None
        owner = rule.expert // (rule.num_experts // topology.moe_ep)
        return range(owner * topology.moe_tp, (owner + 1) * topology.moe_tp)
    return range(topology.world_size)


def amax_reducer(weight_name: str, config: ModelConfig, groups: ParallelGroups) -> AmaxReduce | None:
    """How this rank completes the per-row amax of checkpoint weight `weight_name` (None: it holds whole rows).

    The amaxes of every rank of the weight's group are gathered; those of the ranks holding the same
    rows (all of them; for an expert's `w2`, the ranks of this EP rank's MoE TP group) are maxed.
    """
    topology = groups.topology
    rule = rule_for(weight_name, config, topology)
    if rule.kind not in (WeightKind.ROW, WeightKind.EXPERT_ROW) or rule.group is None:
        return None
    handle = groups[rule.group]
    me = groups.rank
    peers = [
        index for index, rank in enumerate(handle.ranks)
        if rule.kind is WeightKind.ROW or topology.ep_index(rank) == topology.ep_index(me)
    ]
    if len(peers) == 1:
        return None

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        gathered = all_gather(amax.unsqueeze(0).contiguous(), handle, dim=0)
        return gathered[peers].amax(dim=0)

    return reduce
