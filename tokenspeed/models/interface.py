"""`CausalLM`: the contract between a model and the executor.

An abstract nn.Module rather than a Protocol so that callers typed against it
get both the engine contract (`forward(batch, kv)`, `compute_logits`) and the
usual module methods (`eval`, `parameters`). New architectures (MoE, MLA)
subclass it and the executor never learns about them.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import ForwardBatch
    from tokenspeed.batch.kv_storage import PagedKVStorage
    from tokenspeed.models.config import ModelConfig


class CausalLM(nn.Module):
    config: ModelConfig
    # HF checkpoint module name -> (our fused module name, shard id); read by the loader.
    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {}
    # HF checkpoint path part -> ours, where our module is named differently (Mixtral's block_sparse_moe).
    checkpoint_renames: ClassVar[dict[str, str]] = {}

    def optional_checkpoint_modules(self) -> list[str]:
        """Module paths a checkpoint may leave out as a whole (DeepSeek's MTP layers); see `drop_module`."""
        return []

    def drop_module(self, path: str) -> None:
        """Remove an optional module the checkpoint does not carry, rather than keep it with junk weights."""
        raise NotImplementedError(f"{type(self).__name__} has no optional module {path!r}")

    @abstractmethod
    def forward(self, batch: ForwardBatch, kv: PagedKVStorage) -> torch.Tensor:
        """Hidden states `[batch.num_tokens, hidden_size]` after the final norm; writes this step's K/V."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[n, vocab_size]` in fp32 for the given hidden rows."""
