"""Model names resolve the same way for every front end (LLM, AsyncEngine, server)."""

from __future__ import annotations

import json

from tokenspeed.engine.model_files import is_preset, resolve_model_folder


def test_preset_names_resolve_to_a_config_folder():
    for name in ("llama-3.1-8b", "preset:qwen3-8b"):
        assert is_preset(name)
        config = json.loads((resolve_model_folder(name) / "config.json").read_text())
        assert config["hidden_size"] == 4096


def test_paths_and_embedded_are_not_presets(tmp_path):
    assert not is_preset(None) and not is_preset(str(tmp_path)) and not is_preset("no-such-model")
    assert (resolve_model_folder(None) / "model.safetensors").is_file()
