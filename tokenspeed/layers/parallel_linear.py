"""Tensor-parallel linear layers: column-parallel (output features split) and row-parallel (input split).

The classic pairing (Megatron): a column-parallel projection leaves each rank
its slice of the features (q/k/v heads, gate/up intermediate), which the
next local op uses as is; the row-parallel projection after it consumes that
slice and leaves a partial sum (`Partial`). Whether that sum is reduced at
once (`reduce_output=True`) or left for the next norm to fuse is the
placement compiler's decision; a layer that is part of a compiled model
passes `reduce_output=False`.

Weights are this rank's slices, loaded with `load_shard` (column parts) or
copied whole (row), from `placement.ShardedCheckpointReader`, which reads
nothing else. The row-parallel bias is held by every rank and added by the
first one only, so the sum carries it once.

The engine's model families do not use these classes: on N ranks they build
their ordinary layers at local size (`models/parallel/local_config.py`), which
is the same column/row split with the family's fused decode kernels kept,
and the compiled plan runs the collectives (`models/parallel/planned_model.py`).
They remain the reference of the split (`tests/test_placement_distributed.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from tokenspeed.layers.linear import Linear, MergedLinear
from tokenspeed.placement.collectives import all_gather, all_reduce
from tokenspeed.placement.process_groups import GroupHandle


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) does not split over {parts} ranks")
    return total // parts


class ColumnParallelLinear(MergedLinear):
    """y_local = x W_local^T: this rank's 1/size of every part's output features (parts in declared order).

    `part_sizes` are the global output sizes (one part for a plain projection,
    `{"gate": I, "up": I}` for the merged gate/up). `gather_output` all-gathers
    each part's features, giving the whole `y` on every rank.
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: Mapping[str, int],
        group: GroupHandle,
        *,
        bias: bool = False,
        gather_output: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        local = {name: _split(size, group.size, f"part {name!r}") for name, size in part_sizes.items()}
        super().__init__(in_features, local, bias=bias, dtype=dtype, device=device)
        self.group = group
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if not self.gather_output or self.group.size == 1:
            return y
        return torch.cat([all_gather(part, self.group, dim=-1) for part in self.split_output(y)], dim=-1)


class QKVParallelLinear(MergedLinear):
    """The fused q/k/v projection with heads split over `group`; kv heads replicated when size > kv heads.

    A rank holds query heads [r·H/size, (r+1)·H/size) and kv heads
    [r·KV/size, ...) or, when size > KV, the single kv head r·KV // size that
    its query heads attend (`weight_sharding.KV_HEADS`).
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        group: GroupHandle,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        size = group.size
        if size > num_kv_heads and size % num_kv_heads:
            raise ValueError(f"{size} ranks cannot share {num_kv_heads} kv heads evenly")
        self.num_local_heads = _split(num_heads, size, "query heads")
        self.num_local_kv_heads = _split(num_kv_heads, size, "kv heads") if size <= num_kv_heads else 1
        kv = self.num_local_kv_heads * head_dim
        super().__init__(
            hidden_size, {"q": self.num_local_heads * head_dim, "k": kv, "v": kv}, bias=bias, dtype=dtype, device=device
        )
        self.group = group


class RowParallelLinear(Linear):
    """y = x_local W_local^T over this rank's input features: a partial sum, reduced when `reduce_output`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: GroupHandle,
        *,
        bias: bool = False,
        reduce_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        local_in = _split(in_features, group.size, "input features")
        super().__init__(local_in, out_features, bias=bias, dtype=dtype, device=device)
        self.group = group
        self.reduce_output = reduce_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.group.rank == 0 else None
        if x.shape[0] <= self.decode_max_tokens:
            y = self._decode_gemm(x, self.weight, bias)  # type: ignore[misc]
        else:
            y = F.linear(x, self.weight, bias)
        return all_reduce(y, self.group) if self.reduce_output else y
