"""Architecture name -> model builder.

The `architectures[0]` string of a HF config is the only dispatch key, so an
unsupported checkpoint fails at build time with the list of what would work,
never later with a missing-tensor error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tokenspeed.errors import ModelNotSupported
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tokenspeed.models.interface import CausalLM
from tokenspeed.models.llama import DenseDecoderForCausalLM
from tokenspeed.models.moe_decoder import MixtralForCausalLM, Qwen3MoeForCausalLM

ModelBuilder = Callable[..., CausalLM]

_BUILDERS: dict[str, ModelBuilder] = {
    "LlamaForCausalLM": DenseDecoderForCausalLM,
    "MistralForCausalLM": DenseDecoderForCausalLM,
    "Qwen2ForCausalLM": DenseDecoderForCausalLM,
    "Qwen3ForCausalLM": DenseDecoderForCausalLM,
    # Mixture of experts (models/moe_decoder.py).
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    # Multi-head latent attention + MoE (models/deepseek.py).
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_BUILDERS)


def build_model(
    config: ModelConfig | Mapping[str, Any],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Instantiate the model for `config` with uninitialised weights; call `load_weights` next."""
    if not isinstance(config, ModelConfig):
        config = ModelConfig.from_dict(config)
    builder = _BUILDERS.get(config.architecture)
    if builder is None:
        raise ModelNotSupported(
            f"unsupported architecture {config.architecture!r}; "
            f"supported architectures: {', '.join(supported_architectures())}"
        )
    return builder(config, dtype=dtype, device=device)
