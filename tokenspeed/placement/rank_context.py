"""`RankContext`: which rank of which world a model is being built for, and the sizes that rank holds.

A model family is written once, at full size; on N ranks every rank builds
the same classes from a *local* model config (`models.parallel.local_config`:
its share of the attention heads, kv heads and dense intermediate size) and
the layers whose split is not a plain size (vocab-parallel embedding and LM
head, the routed experts of an EP rank, the shared experts over the whole
world) ask `current_rank_context()` while they are constructed. The context
is set only around `build_model` (`building_for_rank`), so a single-device
build never sees one and builds exactly what it always did.

The sizes here are the ones `weight_sharding.slice_for_rank` cuts the
checkpoint into, so what a rank reads fits what it built, tensor for tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from tokenspeed.placement.parallel_config import ParallelConfigError, Topology
from tokenspeed.placement.placements import ParallelGroup
from tokenspeed.placement.process_groups import GroupHandle, ParallelGroups


@dataclass(frozen=True, slots=True)
class RankContext:
    """Rank `rank` of `groups.topology`, with its group handles (process groups inside)."""

    groups: ParallelGroups

    @property
    def topology(self) -> Topology:
        return self.groups.topology

    @property
    def rank(self) -> int:
        return self.groups.rank

    def group(self, kind: ParallelGroup) -> GroupHandle:
        return self.groups[kind]

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """(first global expert id, count) of the routed experts this rank's EP index holds."""
        ep = self.topology.moe_ep
        if num_experts % ep:
            raise ParallelConfigError(f"{num_experts} routed experts do not split over EP={ep}")
        count = num_experts // ep
        return self.topology.ep_index(self.rank) * count, count

    def moe_intermediate(self, size: int) -> int:
        """One routed expert's intermediate size on this rank (split over MoE TP)."""
        return _split(size, self.topology.moe_tp, "expert intermediate size")

    def shared_intermediate(self, size: int) -> int:
        """The shared experts' intermediate size on this rank (split over MOE_TP_EP, the whole world)."""
        return size if self.topology.moe_all_to_all else _split(size, self.topology.world_size,
                                                                "shared-expert intermediate size")


_current: ContextVar[RankContext | None] = ContextVar("tokenspeed_rank_context", default=None)


def current_rank_context() -> RankContext | None:
    """The rank a model is being built for; None on a single device (or outside `building_for_rank`)."""
    return _current.get()


@contextmanager
def building_for_rank(context: RankContext | None) -> Iterator[None]:
    token = _current.set(context)
    try:
        yield
    finally:
        _current.reset(token)


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ParallelConfigError(f"{what} {total} does not split over {parts} ranks")
    return total // parts
