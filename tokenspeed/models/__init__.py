"""Models: HF `config.json` -> `ModelConfig` -> nn.Module built from `tokenspeed.layers`, plus weight loading."""

from tokenspeed.models.config import ModelConfig
from tokenspeed.models.interface import CausalLM
from tokenspeed.models.loader import WeightLoadError, load_weights
from tokenspeed.models.presets import list_presets, load_preset
from tokenspeed.models.registry import build_model, supported_architectures

__all__ = [
    "CausalLM",
    "ModelConfig",
    "WeightLoadError",
    "build_model",
    "list_presets",
    "load_preset",
    "load_weights",
    "supported_architectures",
]
