"""`config.json` files of real models, shipped with the engine.

They let benchmarks and capacity planning run at true shapes with dummy
weights (`load_format="dummy"`) on machines that never downloaded the
checkpoint. Each file is the model's published config.json, unmodified.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from tokenspeed.models.config import ModelConfig


def list_presets() -> list[str]:
    files = resources.files(__name__).iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def preset_dict(name: str) -> dict[str, Any]:
    """The raw config.json of preset `name` (e.g. "llama-3.1-8b"; a trailing ".json" is accepted)."""
    key = name.strip().lower().removesuffix(".json")
    if key not in list_presets():
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(list_presets())}")
    data: dict[str, Any] = json.loads(resources.files(__name__).joinpath(f"{key}.json").read_text())
    return data


def load_preset(name: str) -> ModelConfig:
    return ModelConfig.from_dict(preset_dict(name))
