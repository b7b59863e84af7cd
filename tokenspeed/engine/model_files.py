"""A model's files: find its folder, then read what the front ends need from it (tokenizer, EOS ids).

`--model` names an embedded model (`embedded`, `embedded-moe`), a preset, a
local folder, or a hub id. Presets are real model shapes with no weights
(`preset:qwen3-8b`, or the bare lower-case name exactly as listed): their
folder holds the config (and tokenizer where one can be built offline), and
the engine gives them random weights (`is_preset`). A name that is none of
these gets an error that lists the presets, and names the one it resembles.

A hub id is tried only when the string cannot be a local path, and only
through `huggingface_hub`'s cache/download, so an offline machine gets a
clear `ModelNotFound` instead of a hang or a half-built engine.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from tokenspeed.errors import ModelNotFound, ModelNotSupported


def resolve_model_folder(model: str | None) -> Path:
    from tokenspeed.models.embedded.materialize import embedded_model_path, is_embedded_model
    from tokenspeed.models.presets import PREFIX, materialize_preset, preset_name

    if model is None or is_embedded_model(model):
        return embedded_model_path(model or "embedded")
    path = Path(model).expanduser()
    if is_preset(model):
        return materialize_preset(preset_name(model) or "")
    if model[: len(PREFIX)].lower() == PREFIX:
        raise ModelNotFound(f"Unknown preset {model!r}. {_presets_line()}")
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
                f"Model {model!r} is not a local folder and could not be fetched from the hub: {exc}\n"
                f"{_presets_line(model)}"
            ) from exc
    raise ModelNotFound(f"Model path {model!r} does not exist (looked in {os.getcwd()}).\n{_presets_line(model)}")


def is_preset(model: str | None) -> bool:
    """True when `model` names a built-in preset rather than an existing path."""
    from tokenspeed.models.presets import preset_name

    return model is not None and not Path(model).expanduser().exists() and preset_name(model) is not None


def _presets_line(model: str | None = None) -> str:
    """The presets, and the one `model` resembles (`Qwen/Qwen3-8B` -> `preset:qwen3-8b`), if any."""
    from tokenspeed.models.presets import PREFIX, list_presets, presets_help

    line = f"Presets (real model shapes with random weights): {presets_help()}."
    if model:
        key = model.rstrip("/").rsplit("/", 1)[-1].lower()
        if key in list_presets():
            line += f" For random weights of {model}'s shape, use --model {PREFIX}{key}."
    return line


# ---- tokenizer and EOS ids ---------------------------------------------------------------

# transformers' AutoTokenizer reads config.json to pick a tokenizer class and, for a
# model type it does not know, warns "You are using a model of type X to instantiate a
# model of type ...". We use the tokenizer only, never that config, so the warning says
# nothing true about our run; it is dropped for the threads loading a tokenizer here.
_TOKENIZER_THREADS: set[int] = set()
_FOREIGN_MODEL_TYPE = "You are using a model of type"


class _TokenizerConfigNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.thread in _TOKENIZER_THREADS and str(record.msg).startswith(_FOREIGN_MODEL_TYPE))


_config_logger = logging.getLogger("transformers.configuration_utils")
if not any(isinstance(f, _TokenizerConfigNoise) for f in _config_logger.filters):
    _config_logger.addFilter(_TokenizerConfigNoise())


def load_tokenizer(source: str | Path, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer, with no length limit of its own.

    Prompt length is checked against `max_model_len` at admission, with a
    clear error; the tokenizer's `model_max_length` would only add
    transformers' "Token indices sequence length is longer..." warning first.
    A tokenizer that is the checkpoint's own code (Kimi-K2's) runs only with
    `trust_remote_code`; the flag is always passed as a bool, because left
    unset transformers asks on the terminal and waits for an answer.
    """
    from transformers import AutoTokenizer

    thread = threading.get_ident()
    _TOKENIZER_THREADS.add(thread)
    try:
        return AutoTokenizer.from_pretrained(
            str(source), model_max_length=sys.maxsize, trust_remote_code=trust_remote_code
        )
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ModelNotSupported(
            f"the tokenizer of {source} is the checkpoint's own code (tokenizer_config.json's auto_map); "
            "to run it, pass --trust-remote-code (LLM(trust_remote_code=True))"
        ) from None
    finally:
        _TOKENIZER_THREADS.discard(thread)


def eos_token_ids(folder: Path, model_config: Any, tokenizer: Any | None) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer: any of them ends a turn.

    The one set for every front end (`LLM`, `AsyncEngine`, hence the HTTP and gRPC servers).
    """
    ids: list[int] = []

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):  # JSON gives lists, ModelConfig tuples
            ids.extend(v for v in value if isinstance(v, int))

    generation_config = Path(folder) / "generation_config.json"
    if generation_config.is_file():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    add(getattr(model_config, "eos_token_ids", None) or getattr(model_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
