"""Find a model's folder: an embedded model (`embedded`, `embedded-moe`), a preset, a local folder, or a hub id.

Presets (`llama-3.1-8b`, `preset:qwen3-8b`) are real model shapes with no
weights: their folder holds the config (and tokenizer where one can be built
offline), and the engine gives them dummy weights (`is_preset`).

A hub id is tried only when the string cannot be a local path, and only
through `huggingface_hub`'s cache/download, so an offline machine gets a
clear `ModelNotFound` instead of a hang or a half-built engine.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenspeed.errors import ModelNotFound


def resolve_model_folder(model: str | None) -> Path:
    from tokenspeed.models.embedded.materialize import embedded_model_path, is_embedded_model

    if is_embedded_model(model):
        return embedded_model_path(model or "embedded")
    path = Path(model).expanduser()
    if is_preset(model):
        from tokenspeed.models.presets import materialize_preset, preset_name

        return materialize_preset(preset_name(model) or "")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"Model folder {path} has no config.json.")
        return path
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~")) and not path.exists()
    if looks_like_hub_id:
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(
                model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
            return Path(local)
        except Exception as exc:  # the hub raises many types; all mean "not available here"
            raise ModelNotFound(
                f"Model {model!r} is not a local folder and could not be fetched from the hub: {exc}"
            ) from exc
    raise ModelNotFound(f"Model path {model!r} does not exist (looked in {os.getcwd()}).")


def is_preset(model: str | None) -> bool:
    """True when `model` names a built-in preset rather than an existing path."""
    from tokenspeed.models.presets import preset_name

    return model is not None and not Path(model).expanduser().exists() and preset_name(model) is not None
