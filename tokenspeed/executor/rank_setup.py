"""`RankSetup`: what an `Executor` needs to be one rank of several, and the rank's start-up handshake.

`join_world` is the same on every rank (rank 0 in the engine's process, the
others in the worker processes `multi_rank.py` spawns): join torch.distributed
(gloo on the CPU, NCCL on CUDA) with a bounded collective timeout, create the
parallel groups of the topology, whose collectives are bounded by the step
timeout, and a gloo group for start-up agreements. Joining and start-up get a
long timeout: each rank imports, loads weights and sizes its KV pool at its
own pace, which must not be held to the step timeout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenspeed.placement.parallel_config import Topology
from tokenspeed.placement.process_groups import ParallelGroups, create_parallel_groups, init_distributed

# A collective that waits longer than this for a peer fails (a hung or dead rank -> EngineDead). NCCL gets
# longer: ranks JIT-compile and tune kernels on first use, each at its own pace, and NCCL's watchdog ends
# the process rather than raising when it fires.
_TIMEOUT_S = {"cpu": 10.0, "cuda": 60.0}


def step_timeout_s(device_type: str) -> float:
    return float(os.environ.get("TOKENSPEED_RANK_TIMEOUT_S", _TIMEOUT_S.get(device_type, 10.0)))


STARTUP_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class RankSetup:
    groups: ParallelGroups
    control: dist.ProcessGroup  # gloo, STARTUP_TIMEOUT_S

    @property
    def rank(self) -> int:
        return self.groups.rank

    def agree_num_pages(self, num_pages: int) -> int:
        """The smallest KV page count of all ranks (each sized its pool from its own device's memory)."""
        value = torch.tensor([num_pages], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.control)
        return int(value.item())


def join_world(topology: Topology, rank: int, init_method: str, device_type: str) -> RankSetup:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    init_distributed(rank, topology.world_size, init_method, device_type=device_type, timeout_s=STARTUP_TIMEOUT_S)
    groups = create_parallel_groups(topology, rank, timeout_s=step_timeout_s(device_type))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    return RankSetup(groups, control)


def leave_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
