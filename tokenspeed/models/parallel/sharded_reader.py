"""Read one rank's slices of a safetensors checkpoint, never a whole sharded tensor.

Each tensor's rule (`weight_sharding.rule_for`) gives the rank's slice;
`safe_open(...).get_slice(name)[...]` then reads only those bytes from the
memory-mapped file, so a rank's host memory and I/O are its share of the
model, not the model: 1/N of every split tensor plus the replicated ones, and
no byte of another EP rank's experts. `ReadStats` counts what was read, for
logs and for the test that holds each rank to its share.

An FP8 checkpoint's weight scales follow their weight, which needs the
weight's shape, so the headers of every file are indexed first: a block-FP8
`weight_scale_inv` is read for the blocks the rank's slice of the weight
falls in (`fp8_sharding.scale_slice`); a per-tensor or per-channel
`weight_scale` (a few bytes per row) is read whole, made one scale per row
of the whole weight (`loader.scales_per_row`, which checks it), and cut to
the rank's rows: all of them where the weight is split by its input
features, its slice of rows where split by its output features. A scale
whose weight the checkpoint lacks cannot be cut (its weight's shape decides
the cut): it comes as None to the ranks that would hold the weight, whose
loader reports the weight missing, as the one-device loader does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from tokenspeed.models.loader import find_weight_files, scales_per_row, tensor_shapes
from tokenspeed.models.parallel.fp8_sharding import scale_slice
from tokenspeed.models.parallel.weight_sharding import (
    WHOLE,
    ShardRule,
    TensorSlice,
    rank_holds,
    rule_for,
    slice_for_rank,
)
from tokenspeed.placement.parallel_config import Topology

if TYPE_CHECKING:
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.quant_config import Fp8Config

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers old checkpoints saved; the loader skips them too


@dataclass(slots=True)
class ReadStats:
    sharded_bytes: int = 0  # read from tensors split over ranks
    replicated_bytes: int = 0  # read from tensors every rank holds whole
    tensors_read: int = 0
    tensors_skipped: int = 0  # held by other ranks only (experts of other EP ranks)

    @property
    def bytes_read(self) -> int:
        return self.sharded_bytes + self.replicated_bytes


class ShardedCheckpointReader:
    """The tensors of `folder` as rank `rank` of `topology` holds them: (name, slice tensor, slice).

    `fp8`: how the checkpoint holds its FP8 weights (its `quantization_config`), None for an unquantised one.
    """

    def __init__(
        self,
        folder: str | Path,
        config: ModelConfig,
        topology: Topology,
        rank: int,
        *,
        fp8: Fp8Config | None = None,
    ) -> None:
        self.files = find_weight_files(Path(folder))
        self.config = config
        self.topology = topology
        self.rank = rank
        self.fp8 = fp8 if fp8 is not None and fp8.serialized else None
        self.stats = ReadStats()

    def _weight_of_scale(self, name: str) -> str | None:
        """The FP8 weight whose scales tensor `name` holds; None for any other tensor."""
        return None if self.fp8 is None else self.fp8.weight_of_scale(name)

    def _rule_and_part(
        self, name: str, shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]]
    ) -> tuple[ShardRule, TensorSlice | None]:
        """A tensor's sharding rule and this rank's slice of it; an FP8 weight's scales follow their weight."""
        weight = self._weight_of_scale(name)
        if self.fp8 is None or weight is None:
            rule = rule_for(name, self.config, self.topology)
            return rule, slice_for_rank(name, rule, shape, self.topology, self.rank)
        rule = rule_for(weight, self.config, self.topology)
        part = slice_for_rank(weight, rule, shapes[weight], self.topology, self.rank)
        assert self.fp8.block_size is not None  # a serialized checkpoint's
        return rule, None if part is None else scale_slice(weight, part, shapes[weight], self.fp8.block_size)

    def _read(self, f: Any, lazy: Any, name: str, part: TensorSlice, shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
        """This rank's `part` of tensor `name` (`lazy`, its slice handle in open file `f`): per-tensor /
        per-channel scales read whole."""
        weight = None if self.fp8 is None else self.fp8.weight_of_row_scales(name)
        if weight is not None:  # one per row of the whole weight, then the rank's rows
            return scales_per_row(self.fp8, name, f.get_tensor(name), shapes)[part.index(2)]
        return lazy[part.index(len(lazy.get_shape()))]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None, TensorSlice]]:
        """(name, this rank's slice, the slice) per tensor the rank holds; (name, None, WHOLE) for an FP8
        scale of a weight the rank would hold and the checkpoint lacks (module docstring)."""
        shapes = tensor_shapes(self.files) if self.fp8 is not None else {}
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for name in list(f.keys()):  # a safe_open handle is not iterable
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    weight = self._weight_of_scale(name)
                    if weight is not None and weight not in shapes:
                        if rank_holds(weight, rule_for(weight, self.config, self.topology), self.topology, self.rank):
                            yield name, None, WHOLE
                        else:  # another EP rank's expert: that rank reports it
                            self.stats.tensors_skipped += 1
                        continue
                    lazy = f.get_slice(name)
                    shape = tuple(lazy.get_shape())
                    rule, part = self._rule_and_part(name, shape, shapes)
                    if part is None:
                        self.stats.tensors_skipped += 1
                        continue
                    tensor = self._read(f, lazy, name, part, shapes)
                    nbytes = tensor.numel() * tensor.element_size()
                    if rule.sharded:
                        self.stats.sharded_bytes += nbytes
                    else:
                        self.stats.replicated_bytes += nbytes
                    self.stats.tensors_read += 1
                    yield name, tensor, part
