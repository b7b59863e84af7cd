"""Read one rank's slices of a safetensors checkpoint, never a whole sharded tensor.

Each tensor's rule (`weight_sharding.rule_for`) gives the rank's slice;
`safe_open(...).get_slice(name)[...]` then reads only those bytes from the
memory-mapped file, so a rank's host memory and I/O are its share of the
model, not the model: 1/N of every split tensor plus the replicated ones, and
no byte of another EP rank's experts. `ReadStats` counts what was read, for
logs and for the test that holds each rank to its share.

A block-FP8 checkpoint's `weight_scale_inv` follows its weight: the rank
reads the scales of the blocks its slice of the weight falls in
(`fp8_sharding.scale_slice`), which needs the weight's shape, so the
headers of every file are indexed first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from tokenspeed.kernels.quant.fp8 import BlockSize
from tokenspeed.models.loader import find_weight_files
from tokenspeed.models.parallel.fp8_sharding import scale_slice, weight_of
from tokenspeed.models.parallel.weight_sharding import ShardRule, TensorSlice, rule_for, slice_for_rank
from tokenspeed.placement.parallel_config import Topology

if TYPE_CHECKING:
    from tokenspeed.models.config import ModelConfig

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

    `fp8_block`: the checkpoint's FP8 weight block (its `quantization_config`), None for an unquantised one.
    """

    def __init__(
        self,
        folder: str | Path,
        config: ModelConfig,
        topology: Topology,
        rank: int,
        *,
        fp8_block: BlockSize | None = None,
    ) -> None:
        self.files = find_weight_files(Path(folder))
        self.config = config
        self.topology = topology
        self.rank = rank
        self.fp8_block = fp8_block
        self.stats = ReadStats()

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for name in list(f.keys()):
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        return shapes

    def _rule_and_part(
        self, name: str, shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]]
    ) -> tuple[ShardRule, TensorSlice | None]:
        """A tensor's sharding rule and this rank's slice of it; a block-FP8 scale follows its weight."""
        block, weight = self.fp8_block, weight_of(name)
        if block is None or weight is None or weight not in shapes:  # a scale without its weight: the loader says
            rule = rule_for(name, self.config, self.topology)
            return rule, slice_for_rank(name, rule, shape, self.topology, self.rank)
        rule = rule_for(weight, self.config, self.topology)
        part = slice_for_rank(weight, rule, shapes[weight], self.topology, self.rank)
        return rule, None if part is None else scale_slice(weight, part, shapes[weight], block)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor, TensorSlice]]:
        shapes = self._shapes() if self.fp8_block is not None else {}
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for name in list(f.keys()):  # a safe_open handle is not iterable
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    lazy = f.get_slice(name)
                    shape = tuple(lazy.get_shape())
                    rule, part = self._rule_and_part(name, shape, shapes)
                    if part is None:
                        self.stats.tensors_skipped += 1
                        continue
                    tensor = lazy[part.index(len(shape))]
                    nbytes = tensor.numel() * tensor.element_size()
                    if rule.sharded:
                        self.stats.sharded_bytes += nbytes
                    else:
                        self.stats.replicated_bytes += nbytes
                    self.stats.tensors_read += 1
                    yield name, tensor, part
