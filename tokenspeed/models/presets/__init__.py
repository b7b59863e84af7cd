"""`config.json` files of real models, shipped with the engine.

They let benchmarks and capacity planning run at true shapes with dummy
weights (`load_format="dummy"`) on machines that never downloaded the
checkpoint. Each file is the model's published config.json, unmodified,
except where its `tokenspeed_description` says how and why (FP8 variants,
a depth reduced to fit one GPU).
A materialised folder also holds the preset's tokenizer and chat template
when they can be built offline (see `tokenizers.py`).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from tokenspeed.models.config import ModelConfig


def list_presets() -> list[str]:
    files = resources.files(__name__).iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def preset_dict(name: str) -> dict[str, Any]:
    """The raw config.json of preset `name` (e.g. "llama-3.1-8b"; "preset:" and ".json" are accepted)."""
    key = name.strip().lower().removeprefix("preset:").removesuffix(".json")
    if key not in list_presets():
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(list_presets())}")
    data: dict[str, Any] = json.loads(resources.files(__name__).joinpath(f"{key}.json").read_text())
    return data


def load_preset(name: str) -> ModelConfig:
    return ModelConfig.from_dict(preset_dict(name))


PREFIX = "preset:"


def preset_name(model: str | None) -> str | None:
    """The preset a `--model` value names, if any: `preset:NAME`, or NAME exactly as listed.

    A bare name must match exactly (lower case): `Qwen3-8B` is not the `qwen3-8b`
    preset. Someone who types a real model's name means its weights, and
    silently getting random ones of an 8B shape is the worst answer. The bare
    lower-case names stay because they are ours (scripts and benchmarks use
    them) and cannot be mistaken for a hub id, which is always `owner/name`.
    """
    if not model:
        return None
    if model[: len(PREFIX)].lower() == PREFIX:
        key = model[len(PREFIX) :].strip().lower().removesuffix(".json")
        return key if key in list_presets() else None
    return model if model in list_presets() else None


def presets_help() -> str:
    """The presets as a user may write them, for error messages and `--help`."""
    return ", ".join(PREFIX + name for name in list_presets())


def materialize_preset(name: str) -> Path:
    """A checkpoint folder holding the preset's config.json (no weights: load it with load_format="dummy").

    The tokenizer files are built there at first use (cached) when an offline source exists.
    """
    data = preset_dict(name)
    key = name.strip().lower().removeprefix("preset:").removesuffix(".json")
    root = Path(os.environ.get("TOKENSPEED_CACHE_DIR") or Path.home() / ".cache" / "tokenspeed")
    folder = root / f"preset-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "config.json"
    text = json.dumps(data, indent=2, sort_keys=True)
    if not target.is_file() or target.read_text() != text:
        staging = folder / f".config.json.{os.getpid()}"
        staging.write_text(text)
        staging.replace(target)
    from tokenspeed.models.presets.tokenizers import write_tokenizer_files

    write_tokenizer_files(key, folder)
    return folder
