"""Materialise the embedded tiny model as an ordinary checkpoint folder.

The repo ships a real tokenizer, a chat template and a tiny Qwen3 config; the
weights are random (fixed seed) and written once to a cache folder as
safetensors, so the default model goes through exactly the loading path a
real checkpoint does, and `transformers` can load the same folder for parity
checks. Its output text is not meaningful: it exists so every command works
on a fresh machine with no download.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

_ASSETS = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_WEIGHT_SEED = 1234
_INIT_STD = 0.02


def _asset_dir() -> Path:
    return Path(str(resources.files("tokenspeed.models.embedded")))


def _cache_root() -> Path:
    env = os.environ.get("TOKENSPEED_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tokenspeed"


def _fingerprint() -> str:
    digest = hashlib.sha256(str(_WEIGHT_SEED).encode())
    for name in _ASSETS:
        digest.update((_asset_dir() / name).read_bytes())
    return digest.hexdigest()[:16]


def _random_weights(config: dict[str, object]) -> dict[str, object]:
    """HF-named tensors of the right shapes; norms start at one, everything else ~N(0, 0.02)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    generator = torch.Generator().manual_seed(_WEIGHT_SEED)
    tensors: dict[str, object] = {}
    for name, param in sorted(skeleton.state_dict().items()):
        if hf_config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(param.shape)
        else:
            tensors[name] = torch.randn(param.shape, generator=generator) * _INIT_STD
    return tensors


def embedded_model_path() -> Path:
    """The folder of the embedded model, built on first use (atomic: safe under concurrent first calls)."""
    target = _cache_root() / f"embedded-{_fingerprint()}"
    if (target / "model.safetensors").is_file():
        return target
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="embedded-", dir=target.parent))
    try:
        for name in _ASSETS:
            shutil.copyfile(_asset_dir() / name, staging / name)
        config = json.loads((staging / "config.json").read_text())
        save_file(_random_weights(config), str(staging / "model.safetensors"))  # type: ignore[arg-type]
        with contextlib.suppress(OSError):  # another process won the race; its folder is identical
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
