"""Qwen3-MoE and Mixtral: the dense decoder with `SparseMoE` feed-forward blocks.

Attention, norms, rope and the residual stream are exactly the dense
decoder's (`ModelConfig` already resolved Qwen3's q/k norm and Mixtral's
optional sliding window), so these models only override `build_mlp` and
inherit every speed-up made to the dense path.

Per-layer choice: `MoEConfig.sparse_layers` says which layers route; the
others (Qwen3-MoE `mlp_only_layers`, or layers off `decoder_sparse_step`) keep
a dense `GatedMLP` of `intermediate_size`, loaded through the usual
`gate_proj`/`up_proj` packing.

Checkpoint names: Qwen3-MoE's match ours (`mlp.gate`, `mlp.experts.{e}.gate_proj`).
Mixtral checkpoints call the block `block_sparse_moe` and its expert
projections `w1`/`w3`/`w2`; our block keeps the attribute name `mlp` (the one
the shared decoder layer calls, and the name transformers v5 itself renames
it to), and the model declares the rename for the loader.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenspeed.layers.moe import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, ExpertNames, SparseMoE
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.llama import DecoderLayer, DenseDecoderForCausalLM


class MoEDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is a `SparseMoE` where `MoEConfig.sparse_layers` says so."""

    expert_names: ClassVar[ExpertNames] = QWEN_EXPERT_NAMES

    def build_mlp(
        self, config: ModelConfig, index: int, *, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        if config.moe is None:
            raise ValueError(f"{config.architecture} config has no mixture-of-experts section")
        if not config.moe.is_sparse(index):
            return super().build_mlp(config, index, dtype=dtype, device=device)
        return SparseMoE(
            config.hidden_size, config.moe, expert_names=self.expert_names, dtype=dtype, device=device
        )


class MixtralDecoderLayer(MoEDecoderLayer):
    expert_names: ClassVar[ExpertNames] = MIXTRAL_EXPERT_NAMES


class Qwen3MoeForCausalLM(DenseDecoderForCausalLM):
    """Qwen3-MoE (e.g. Qwen3-30B-A3B): q/k-normed GQA attention, top-k softmax routing."""

    layer_class: ClassVar[type[DecoderLayer]] = MoEDecoderLayer


class MixtralForCausalLM(DenseDecoderForCausalLM):
    """Mixtral: Mistral attention (sliding window when set), top-2 softmax routing."""

    layer_class: ClassVar[type[DecoderLayer]] = MixtralDecoderLayer
    checkpoint_renames: ClassVar[dict[str, str]] = {"block_sparse_moe": "mlp"}
