"""`ModelGraph`: the modules a model's forward pass runs, in order, each with its kind.

This is what the placement compiler walks. Every supported family has the
same skeleton (embedding; per layer: input norm, attention, post-attention
norm, feed-forward; final norm; LM head); what differs per family is read
from `ModelConfig`:

| family | attention | feed-forward |
|---|---|---|
| Llama, Mistral, Qwen2, Qwen3 | GQA (`attention`) | dense MLP |
| Qwen3-MoE, Mixtral | GQA | MoE where `MoEConfig.sparse_layers` says, else dense MLP |
| DeepSeek-V2/V3 (Kimi-K2, Moonlight) | MLA (`mla_attention`) | dense MLP for the first layers, then MoE |

DeepSeek's MTP layers are not in the graph: the forward pass never runs them
(they are the drafter of speculative decoding); their weights are still
counted by `weight_inventory.py`. Module names are the model's own
(`model.layers.3.self_attn`), so a plan line points at real code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenspeed.placement.module_specs import ModuleKind

if TYPE_CHECKING:
    from tokenspeed.placement.model_shape import ModelShape


@dataclass(frozen=True, slots=True)
class ModuleRef:
    name: str  # the module's attribute path in the model, e.g. "model.layers.0.mlp"
    kind: ModuleKind
    layer: int | None = None  # decoder layer index; None for the embedding, final norm and LM head

    @property
    def short_name(self) -> str:
        """The name inside its layer ("mlp"), or the whole name outside the layers."""
        return self.name if self.layer is None else self.name.removeprefix(f"model.layers.{self.layer}.")


@dataclass(frozen=True, slots=True)
class ModelGraph:
    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    top_k: int  # experts per token (0 without MoE): sizes the all-to-all
    modules: tuple[ModuleRef, ...]


def describe_model(config: ModelShape) -> ModelGraph:
    attention = ModuleKind.ATTENTION if config.mla is None else ModuleKind.MLA_ATTENTION
    modules = [ModuleRef("model.embed_tokens", ModuleKind.EMBEDDING)]
    for i in range(config.num_layers):
        sparse = config.moe is not None and config.moe.is_sparse(i)
        prefix = f"model.layers.{i}"
        modules += [
            ModuleRef(f"{prefix}.input_layernorm", ModuleKind.NORM, i),
            ModuleRef(f"{prefix}.self_attn", attention, i),
            ModuleRef(f"{prefix}.post_attention_layernorm", ModuleKind.NORM, i),
            ModuleRef(f"{prefix}.mlp", ModuleKind.MOE if sparse else ModuleKind.DENSE_MLP, i),
        ]
    modules += [ModuleRef("model.norm", ModuleKind.NORM), ModuleRef("lm_head", ModuleKind.LM_HEAD)]
    return ModelGraph(
        architecture=config.architecture,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_layers=config.num_layers,
        top_k=config.moe.top_k if config.moe is not None else 0,
        modules=tuple(modules),
    )
