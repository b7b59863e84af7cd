"""DeepSeek-V2 / V2-Lite / V3 (and Kimi-K2, Moonlight): MLA attention + DeepSeek MoE.

One implementation serves both architectures: what differs between them is
read from `config.json` into `MLAConfig` (rope layout, q low-rank) and
`MoEConfig` (greedy / group-limited softmax routing vs noaux_tc sigmoid routing
with a correction bias, scaling, shared experts, which layers are dense), so
the two classes below only name the architectures.

Layer i: RMSNorm -> `MLAAttention` (latent KV cache, `layers/mla.py`) ->
RMSNorm -> dense `GatedMLP` (i < first_k_dense_replace) or `SparseMoE` with
shared experts. The residual stream is added inside the next norm, as in
the dense decoder.

Multi-token prediction (`num_nextn_predict_layers`, V3): checkpoints carry
extra layers `model.layers.{N..}` (N = num_hidden_layers) holding a full
decoder layer plus `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}` and
their own `embed_tokens`. They are built and loaded (`MTPLayer`) so real
checkpoints load unchanged and the dummy loader fills them, but the forward
pass never runs them: they are the draft model of MTP speculative decoding
(`spec/`), which has no KV cache of its own yet. Checkpoints saved by
transformers drop these tensors while keeping `num_nextn_predict_layers`, so
the layers are optional: a checkpoint without any of their tensors loads and
the layers are dropped (one with only some of them is still an error).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tokenspeed.errors import ModelNotSupported
from tokenspeed.layers.embedding import LMHead, VocabEmbedding
from tokenspeed.layers.linear import Linear
from tokenspeed.layers.mla import MLAAttention, mla_softmax_scale
from tokenspeed.layers.mlp import GatedMLP
from tokenspeed.layers.moe import QWEN_EXPERT_NAMES, SparseMoE
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.rotary_embedding import RotaryEmbedding
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.llama import DecoderForCausalLM, DecoderModel

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import AttentionMetadata


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        rotary: RotaryEmbedding,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        assert config.mla is not None
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.self_attn = MLAAttention(
            hidden_size=hidden,
            num_heads=config.num_heads,
            mla=config.mla,
            rotary=rotary,
            scale=mla_softmax_scale(config.mla, config.rope, config.max_position_embeddings),
            rms_norm_eps=eps,
            dtype=dtype,
            device=device,
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.mlp = self.build_mlp(config, self.routes(config, index), dtype=dtype, device=device)

    @staticmethod
    def routes(config: ModelConfig, index: int) -> bool:
        """Whether layer `index` is a `SparseMoE` (past first_k_dense_replace) rather than a dense MLP."""
        return config.moe is not None and config.moe.is_sparse(index)

    @staticmethod
    def build_mlp(
        config: ModelConfig, sparse: bool, *, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        if sparse:
            assert config.moe is not None
            return SparseMoE(
                config.hidden_size, config.moe, expert_names=QWEN_EXPERT_NAMES, dtype=dtype, device=device
            )
        return GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttentionMetadata,
        kv_layer: tuple[torch.Tensor, torch.Tensor | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn, kv_layer[0])
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class SharedHead(nn.Module):
    """An MTP layer's own final norm and LM head (`shared_head.norm`, `shared_head.head`)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.head = LMHead(config.vocab_size, config.hidden_size, dtype=dtype, device=device)


class MTPLayer(DeepseekDecoderLayer):
    """One multi-token-prediction layer, loaded and kept for speculative decoding (see module docstring).

    Its draft step (DeepSeek-V3 §2.2): h' = eh_proj([enorm(embed(next token)) ‖ hnorm(h)]),
    then the decoder layer, then `shared_head`.
    """

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        rotary: RotaryEmbedding,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(config, index, rotary, dtype=dtype, device=device)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, dtype=dtype, device=device)
        self.enorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.eh_proj = Linear(2 * hidden, hidden, dtype=dtype, device=device)
        self.shared_head = SharedHead(config, dtype=dtype, device=device)

    @staticmethod
    def routes(config: ModelConfig, index: int) -> bool:
        """As the last decoder layer (V3: layer 61 is past first_k_dense_replace, so MoE)."""
        return config.num_layers > 0 and DeepseekDecoderLayer.routes(config, config.num_layers - 1)


class DeepseekModel(DecoderModel):
    """The shared decoder stack with MLA/MoE layers, plus the MTP layers that the forward pass skips."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        mla = config.mla
        if mla is None:
            raise ModelNotSupported(
                f"{config.architecture} config has no multi-head latent attention section"
            )
        if config.raw.get("mlp_bias"):
            raise ModelNotSupported("DeepSeek with mlp_bias is unsupported (no DeepSeek checkpoint uses it)")
        super().__init__(
            config,
            dtype=dtype,
            device=device,
            layer_class=DeepseekDecoderLayer,
            rope_head_dim=mla.qk_rope_head_dim,
        )

    def build_layers(
        self,
        config: ModelConfig,
        layer_class: Callable[..., nn.Module],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[nn.Module]:
        # MTP layers continue the numbering (checkpoint names `model.layers.{N+k}`).
        assert config.mla is not None
        end = config.num_layers + config.mla.num_mtp_layers
        return super().build_layers(config, layer_class, dtype=dtype, device=device) + [
            MTPLayer(config, i, self.rotary_emb, dtype=dtype, device=device)
            for i in range(config.num_layers, end)
        ]

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return [layer for layer in self.layers[self.num_layers :] if isinstance(layer, MTPLayer)]


class DeepseekForCausalLM(DecoderForCausalLM):
    """MLA + DeepSeek-MoE causal LM; see the module docstring."""

    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("fused_qkv_a_proj", "q"),  # no q low-rank (V2-Lite, Moonlight)
        "q_a_proj": ("fused_qkv_a_proj", "q_a"),
        "kv_a_proj_with_mqa": ("fused_qkv_a_proj", "kv_a"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    model: DeepseekModel

    def build_model(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> DeepseekModel:
        return DeepseekModel(config, dtype=dtype, device=device)

    def optional_checkpoint_modules(self) -> list[str]:
        return [f"model.layers.{i}" for i in range(self.model.num_layers, len(self.model.layers))]

    def drop_module(self, path: str) -> None:
        if path not in self.optional_checkpoint_modules() or path != f"model.layers.{len(self.model.layers) - 1}":
            super().drop_module(path)  # only the trailing MTP layer can go without renumbering the rest
        del self.model.layers[len(self.model.layers) - 1]


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V2 / V2-Lite: interleaved complex rope, softmax greedy or group-limited routing."""


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V3 / R1, Kimi-K2, Moonlight: sigmoid noaux_tc routing with a correction bias, MTP layers."""
