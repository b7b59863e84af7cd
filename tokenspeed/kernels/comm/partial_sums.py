"""`PartialSums`: where the addends of a pending sum (a `Partial` placement) are, as one rank sees them.

Two transports, which select different kernels (registry trait `transport`):

- `process_group`: this rank holds only its own addend (`local`) and the sum
  is formed by a `torch.distributed` all-reduce over `group` (gloo, NCCL);
- `peer_buffers`: every rank's addend is readable from here (`peers`, in rank
  order, one of them `local`): peer memory mapped by symmetric memory, or, to
  test on one device, the slices of a stacked `[world, tokens, hidden]` tensor
  (`PartialSums.simulated`). A kernel then reads and sums them itself, with
  no separate collective; synchronising with the peers (they must have
  written their addends) is the caller's job.

Neither: world size 1, the sum is `local` itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class PartialSums:
    local: torch.Tensor  # this rank's addend [tokens, hidden]; an all-reduce overwrites it with the sum
    group: dist.ProcessGroup | None = None  # reduce over this group (process_group transport)
    peers: tuple[torch.Tensor, ...] = ()  # every rank's addend in rank order (peer_buffers transport)

    @property
    def world_size(self) -> int:
        if self.peers:
            return len(self.peers)
        return 1 if self.group is None else dist.get_world_size(self.group)

    @classmethod
    def simulated(cls, stacked: torch.Tensor, rank: int = 0) -> PartialSums:
        """Rank `rank` of a world whose addends are the rows of `stacked` [world, tokens, hidden]."""
        peers = tuple(stacked.unbind(0))
        return cls(local=peers[rank], peers=peers)
