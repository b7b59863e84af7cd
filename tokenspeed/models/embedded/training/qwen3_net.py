"""The trainable Qwen3 decoder of the `embedded` model; parameter names are `Qwen3ForCausalLM`'s.

`forward` returns the final hidden states *after* the final norm (what the LM
head reads, transformers' `last_hidden_state`): the feature the EAGLE head is
trained on. Weights are tied (`lm_head` is the embedding) when the config
says so, as in the shipped config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tokenspeed.models.embedded.training.blocks import (
    GroupedQueryAttention,
    RMSNorm,
    SwiGLU,
    init_weights,
    rope_tables,
)


class Qwen3Layer(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = GroupedQueryAttention(config, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, config["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Backbone(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(Qwen3Layer(config) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])


class Qwen3Net(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        if config.get("architectures") != ["Qwen3ForCausalLM"]:
            raise ValueError(f"not a Qwen3 config: {config.get('architectures')}")
        self.config = dict(config)
        self.model = Qwen3Backbone(config)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.rope_theta = float(config.get("rope_theta", 10000.0))
        init_weights(self, config.get("initializer_range", 0.02), config["num_hidden_layers"])

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states `[batch, seq, hidden]` after the final norm."""
        cos, sin = rope_tables(ids.shape[1], self.config["head_dim"], self.rope_theta, ids.device)
        x = self.embed(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensors under transformers' names (a tied head is not stored)."""
        return {name: p.detach() for name, p in self.named_parameters()}

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        wanted = dict(self.named_parameters())
        extra = sorted(set(tensors) - set(wanted) - {"lm_head.weight"})
        missing = sorted(set(wanted) - set(tensors))
        if extra or missing:
            raise ValueError(f"checkpoint does not match Qwen3Net: missing {missing}, unexpected {extra}")
        with torch.no_grad():
            for name, param in wanted.items():
                param.copy_(tensors[name])
