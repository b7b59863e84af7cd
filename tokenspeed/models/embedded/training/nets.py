"""The trainable network of a config: Qwen3 dense, DeepSeek-V3, or an EAGLE head (by its `eagle` section)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tokenspeed.models.embedded.training.deepseek_net import DeepseekNet
from tokenspeed.models.embedded.training.eagle import EagleHead
from tokenspeed.models.embedded.training.qwen3_net import Qwen3Net


def build_net(config: Mapping[str, Any], draft: bool = False) -> nn.Module:
    if draft:
        if "eagle" not in config:
            raise ValueError("a draft head config needs its 'eagle' section")
        return EagleHead(config)
    architecture = (config.get("architectures") or [None])[0]
    if architecture == "Qwen3ForCausalLM":
        return Qwen3Net(config)
    if architecture == "DeepseekV3ForCausalLM":
        return DeepseekNet(config)
    raise ValueError(f"no trainable network for {architecture!r}")
