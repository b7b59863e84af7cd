"""MTP drafting (`speculative_config={"method": "mtp", "num_speculative_tokens": k}`): DeepSeek-V3 / Kimi-K2 /
`embedded-moe` multi-token-prediction layers, which the target loads and keeps (`models/deepseek.py`).

One MTP step at position q (DeepSeek-V3 report, section 2.2), f_q the target's
final hidden state after its final norm (what vLLM and SGLang hand their MTP
drafters, and what `embedded-moe` is trained with) and t_{q+1} the next token:

    x = eh_proj(cat([enorm(embed(t_{q+1})), hnorm(f_q)]))
    x = the layer's decoder block (MLA over its own paged latent cache, MoE or dense MLP)
    f'_{q+1} = shared_head.norm(x)           # drafts t_{q+2} through shared_head.head

Chained for k > 1 (`feature_drafter.py`): `f'_{q+1}` is the next step's
feature, the role f plays for the main model (it is the LM head's input).
A checkpoint with several MTP layers drafts with the first, chained: the
others were trained for positions further ahead, on the first one's output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenspeed.errors import InvalidRequest
from tokenspeed.spec.feature_drafter import FeatureDrafter

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import AttentionMetadata
    from tokenspeed.batch.kv_storage import PagedKVStorage
    from tokenspeed.executor.executor import Executor
    from tokenspeed.models.deepseek import MTPLayer


class MTPDrafter(FeatureDrafter):
    def __init__(self, executor: Executor) -> None:
        layers: list[MTPLayer] = list(getattr(getattr(executor.model, "model", None), "mtp_layers", []))
        if not layers:
            raise InvalidRequest(
                f"speculative_config method 'mtp' needs a model with multi-token-prediction layers "
                f"(DeepSeek-V3, Kimi-K2, embedded-moe); {executor.model_config.architecture} from this checkpoint "
                "has none (num_nextn_predict_layers is 0, or the checkpoint left them out)")
        self.layer = layers[0]
        config = executor.model_config
        assert config.mla is not None
        super().__init__(hidden_size=config.hidden_size, kv_layout=(1, config.mla.cache_dim, 0),
                         page_size=executor.config.page_size, dtype=executor.dtype, device=executor.device,
                         kv_dtype=executor.kv_dtype)

    def step(self, positions: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, attn: AttentionMetadata,
             kv: PagedKVStorage) -> torch.Tensor:
        layer = self.layer
        x = layer.eh_proj(torch.cat([layer.enorm(layer.embed_tokens(tokens)), layer.hnorm(features)], dim=-1))
        hidden, residual = layer(positions, x, None, attn, kv.layer(0))
        features, _ = layer.shared_head.norm(hidden, residual)
        return features

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.layer.shared_head.head(features)
        return logits
