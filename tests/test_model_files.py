"""Model names resolve the same way for every front end (LLM, AsyncEngine, server)."""

from __future__ import annotations

import json

import pytest

from tokenspeed.engine.model_files import is_preset, resolve_model_folder
from tokenspeed.errors import ModelNotFound


def test_preset_names_resolve_to_a_config_folder():
    for name in ("llama-3.1-8b", "preset:qwen3-8b"):
        assert is_preset(name)
        config = json.loads((resolve_model_folder(name) / "config.json").read_text())
        assert config["hidden_size"] == 4096


def test_paths_and_embedded_are_not_presets(tmp_path):
    assert not is_preset(None) and not is_preset(str(tmp_path)) and not is_preset("no-such-model")
    assert (resolve_model_folder(None) / "model.safetensors").is_file()


def test_real_model_names_are_not_presets():
    """Only `preset:NAME` (any case) or the exact lower-case name selects a preset's random weights."""
    assert is_preset("preset:Qwen3-8B") and is_preset("qwen3-8b")
    for name in ("Qwen3-8B", "QWEN3-8B", "Llama-3.1-8B", "qwen3-8b.json", "Qwen/Qwen3-8B"):
        assert not is_preset(name), name


def test_an_unknown_model_lists_the_presets_and_names_the_one_it_resembles():
    with pytest.raises(ModelNotFound) as error:
        resolve_model_folder("Qwen3-8B")
    message = str(error.value)
    assert "does not exist" in message and "preset:llama-3.1-8b" in message
    assert "use --model preset:qwen3-8b" in message
    with pytest.raises(ModelNotFound, match=r"Unknown preset 'preset:qwen9'.*preset:deepseek-v2-lite"):
        resolve_model_folder("preset:qwen9")
