"""torch.distributed process groups for the parallel groups of a `Topology`.

One process per rank (one device each on CUDA). `init_distributed` joins the
world (gloo on the CPU, NCCL on CUDA; nothing at all at world size 1, so a
single-device engine never touches torch.distributed), then
`create_parallel_groups` makes one process group per ATTN_TP and ATTN_DP
group; DENSE_TP and MOE_TP_EP span the world and share one. Every rank must
create every group, in the same order, even those it is not in: that is
torch.distributed's contract, which `Topology.group_ranks` makes
deterministic. A group of one rank gets no process group at all, and the
collective wrappers (`collectives.py`) skip it.

The timeout bounds every collective: a rank that died or hangs turns into an
error on its peers after `timeout_s`, which the multi-rank executor turns into
`EngineDead` rather than a hang.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from tokenspeed.placement.parallel_config import ParallelConfigError, Topology
from tokenspeed.placement.placements import ParallelGroup

DEFAULT_TIMEOUT_S = 120.0


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    device_type: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Join the world as `rank` (no-op at world size 1). `init_method`: "tcp://host:port" or "file://path"."""
    if world_size == 1:
        return
    dist.init_process_group(
        default_backend(device_type),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


@dataclass(frozen=True, slots=True)
class GroupHandle:
    """This rank's group of one kind: its members, its index among them, the process group (None: size 1)."""

    kind: ParallelGroup
    ranks: tuple[int, ...]
    rank: int  # index of this process in `ranks`
    process_group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True, slots=True)
class ParallelGroups:
    topology: Topology
    rank: int
    handles: Mapping[ParallelGroup, GroupHandle]

    def __getitem__(self, kind: ParallelGroup) -> GroupHandle:
        return self.handles[kind]


def create_parallel_groups(topology: Topology, rank: int, *, timeout_s: float | None = None) -> ParallelGroups:
    """This rank's handle of every parallel group (collective: every rank of the world calls it).

    `timeout_s` bounds the groups' collectives (None: the world's timeout), so the world can be joined
    with a generous timeout (ranks start at their own pace) and each step still fail fast."""
    if topology.world_size > 1:
        if not dist.is_initialized():
            raise ParallelConfigError("torch.distributed is not initialised: call init_distributed first")
        if dist.get_world_size() != topology.world_size or dist.get_rank() != rank:
            raise ParallelConfigError(
                f"torch.distributed world (rank {dist.get_rank()} of {dist.get_world_size()}) "
                f"is not rank {rank} of the topology's {topology.world_size}"
            )
    handles: dict[ParallelGroup, GroupHandle] = {}
    world: dist.ProcessGroup | None = None
    for kind in ParallelGroup:
        for ranks in topology.group_ranks(kind):
            whole_world = len(ranks) == topology.world_size
            if len(ranks) == 1:
                process_group = None
            elif whole_world and world is not None:
                process_group = world  # DENSE_TP and MOE_TP_EP share the world's group
            else:
                timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
                process_group = dist.new_group(list(ranks), timeout=timeout)
                world = process_group if whole_world else world
            if rank in ranks:
                handles[kind] = GroupHandle(kind, ranks, ranks.index(rank), process_group)
    return ParallelGroups(topology, rank, handles)
