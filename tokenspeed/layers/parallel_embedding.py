"""Vocab-parallel token embedding and LM head: the vocabulary's rows split evenly over a group.

Embedding: a rank looks up only the ids in its row range and writes zeros
for the others, so the sum over the group (`Partial`, reduced at once with
`reduce_output` or later by the first norm's fused all-reduce) is exactly the
full lookup: adding zeros is exact, the result is bit-for-bit the unsplit one.

LM head: each rank computes the logits of its vocabulary slice (fp32, as
`layers.embedding.LMHead`); `gather_output` all-gathers them so the sampler
(rank 0) sees the whole vocabulary. Tied to a `VocabParallelEmbedding`, it
shares that rank's slice. Under DP attention the embedding is replicated
instead (`layers.embedding.VocabEmbedding`), since each rank embeds its own
requests' tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.placement.collectives import all_gather, all_reduce
from tokenspeed.placement.process_groups import GroupHandle


def _rows_per_rank(vocab_size: int, group: GroupHandle) -> int:
    if vocab_size % group.size:
        raise ValueError(f"vocabulary of {vocab_size} does not split over {group.size} ranks")
    return vocab_size // group.size


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        group: GroupHandle,
        *,
        reduce_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.group = group
        self.reduce_output = reduce_output
        rows = _rows_per_rank(vocab_size, group)
        self.vocab_start = group.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return all_reduce(rows, self.group) if self.reduce_output else rows


class ParallelLMHead(nn.Module):
    """hidden `[n, hidden]` -> logits fp32: this rank's vocabulary slice, or all of it with `gather_output`."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        group: GroupHandle,
        *,
        tied_to: VocabParallelEmbedding | None = None,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        rows = _rows_per_rank(vocab_size, group)
        if tied_to is not None:
            if tied_to.weight.shape != (rows, hidden_size) or tied_to.group != group:
                raise ValueError("a tied LM head must split the vocabulary as its embedding does")
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).float()
        return all_gather(logits, self.group, dim=-1) if self.gather_output else logits
