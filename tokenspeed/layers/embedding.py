"""Token embedding and the LM head, which may share (tie) the embedding matrix.

Tying is done by sharing the very same Parameter, so the loader sees one
tensor (`model.embed_tokens.weight`) and tied checkpoints, which omit
`lm_head.weight`, load without special cases beyond skipping a stray copy.
Logits are returned in fp32: samplers and logprobs need the precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden `[n, hidden]` -> logits `[n, vocab]` fp32; `tied_to` shares the embedding's weight."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tied_to: VocabEmbedding | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            if (tied_to.vocab_size, tied_to.hidden_size) != (vocab_size, hidden_size):
                raise ValueError("a tied LM head must have the embedding's shape")
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
