"""The embedding and LM head a model builds, single-device or vocab-parallel, by the rank it is built for.

Under a `RankContext` with more than one rank the vocabulary's rows are split
over DENSE_TP (`layers/parallel_embedding.py`): the embedding leaves a pending
sum (`Partial`, reduced by the first norm's fused all-reduce as the compiled
plan says) and the head leaves this rank's slice of the logits (gathered by
the plan's last op). Under DP attention the embedding stays whole (each rank
embeds its own requests' tokens). Without a context: the plain layers.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed.layers.embedding import LMHead, VocabEmbedding
from tokenspeed.layers.parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenspeed.placement.parallel_config import ParallelConfigError
from tokenspeed.placement.placements import ParallelGroup
from tokenspeed.placement.rank_context import current_rank_context


def build_embedding(vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    context = current_rank_context()
    if context is None or context.topology.world_size == 1 or context.topology.dp_attention:
        return VocabEmbedding(vocab_size, hidden_size, dtype=dtype, device=device)
    return VocabParallelEmbedding(
        vocab_size, hidden_size, context.group(ParallelGroup.DENSE_TP), reduce_output=False, dtype=dtype, device=device
    )


def build_lm_head(
    vocab_size: int, hidden_size: int, *, tied_to: nn.Module | None, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    context = current_rank_context()
    if context is None or context.topology.world_size == 1:
        assert tied_to is None or isinstance(tied_to, VocabEmbedding)
        return LMHead(vocab_size, hidden_size, tied_to=tied_to, dtype=dtype, device=device)
    if tied_to is not None and not isinstance(tied_to, VocabParallelEmbedding):
        raise ParallelConfigError("a tied LM head needs a vocab-parallel embedding (not under DP attention)")
    return ParallelLMHead(
        vocab_size,
        hidden_size,
        context.group(ParallelGroup.DENSE_TP),
        tied_to=tied_to,
        gather_output=False,
        dtype=dtype,
        device=device,
    )
