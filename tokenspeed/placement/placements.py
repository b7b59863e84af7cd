"""Placements: how a tensor is laid out over the ranks of one parallel group.

A model is written as if on one device; each module then says, per parallel
group, what its input must be and what its output is:

- `Replicate(g)`: every rank of `g` holds the whole tensor;
- `Shard(dim, g)`: the ranks of `g` hold disjoint slices along `dim` (dim 0
  is the token dimension: attention data parallelism; dim -1 a feature
  dimension: vocab-parallel logits);
- `Partial(g)`: every rank of `g` holds an addend; the tensor is their sum
  (the output of a row-parallel GEMM, before its all-reduce).

A `Layout` is a tuple of placements, one per group it speaks of. Groups are
not independent: `DENSE_TP` and `MOE_TP_EP` span the whole world, which is
`ATTN_DP` x `ATTN_TP`. So the compiler reasons per *mesh axis* (`"dp"`,
`"tp"`, see `Topology.axes_of`) and a layout is read as: each axis covered by
one of its placements has that placement, every other axis is replicated.

Why not torch's DTensor: we need none of its tensor subclassing (the model
code handles plain tensors and calls collectives the compiler chose), and the
placements must be printable, hashable records the compiler can reason about
without touching torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ParallelGroup(Enum):
    """The parallel dimensions a module's placement can refer to (sizes: `Topology`)."""

    ATTN_TP = "ATTN_TP"  # attention heads split over these ranks
    ATTN_DP = "ATTN_DP"  # attention data parallel: each group of ranks holds whole requests
    DENSE_TP = "DENSE_TP"  # dense MLP, vocab-parallel embedding and LM head: the whole world
    MOE_TP_EP = "MOE_TP_EP"  # experts split by expert (EP) and by intermediate dim (TP): the whole world


@dataclass(frozen=True, slots=True)
class Replicate:
    group: ParallelGroup

    def __str__(self) -> str:
        return f"Replicate({self.group.value})"


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int  # 0: tokens; -1: features (vocab of logits)
    group: ParallelGroup

    def __str__(self) -> str:
        return f"Shard({self.dim}, {self.group.value})"


@dataclass(frozen=True, slots=True)
class Partial:
    group: ParallelGroup

    def __str__(self) -> str:
        return f"Partial({self.group.value})"


Placement = Replicate | Shard | Partial
Layout = tuple[Placement, ...]

REPLICATED: Layout = ()  # every rank holds the whole tensor


def format_layout(layout: Layout) -> str:
    """`Shard(0, ATTN_DP) + Partial(ATTN_TP)`; `Replicate` for a fully replicated tensor."""
    shown = [p for p in layout if not isinstance(p, Replicate)]
    return " + ".join(str(p) for p in shown) if shown else "Replicate"
