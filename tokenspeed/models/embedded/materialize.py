"""Materialise the embedded models as ordinary checkpoint folders.

Two models ship inside the package, both with the embedded byte-level BPE
tokenizer (vocabulary 4096, trained on Python's standard library) and a
ChatML template:

- `embedded` (the default): Qwen3 dense, `config.json` + `model.safetensors`
  here, and its EAGLE draft head in `eagle/` (format: `training/eagle.py`);
- `embedded-moe`: DeepSeek-V3 shaped (MLA, noaux_tc MoE with a shared expert,
  one MTP layer), `moe/config.json` + `moe/model.safetensors`.

The weights are trained by `scripts/train_embedded.py` and committed as bf16
safetensors. Each model is copied into a cache folder on first use
(`~/.cache/tokenspeed/<name>-<fingerprint>`, or `$TOKENSPEED_CACHE_DIR`), so
it goes through exactly the loading path of any checkpoint and transformers
can load the same folder. The package keeps the MTP layer without its copies
of the embedding and LM head (DeepSeek-V3 shares them with the main model);
the cache folder gets DeepSeek's full layout with the copies written back.

A package without a trained weights file (before the first training run)
still works: the folder gets seeded random weights of the right shapes and a
log line says so; their text is not meaningful.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("tokenspeed.models")

TOKENIZER_ASSETS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
WEIGHTS_FILE = "model.safetensors"
EAGLE_DIR = "eagle"
_FORMAT = "2"  # bump when the folder layout changes, so stale cache folders are not reused
_WEIGHT_SEED = 1234
_FP32_TENSORS = ("e_score_correction_bias",)  # routing choices are sensitive to it; DeepSeek keeps it fp32
_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    name: str
    subdir: str  # folder inside the package holding config.json and the trained weights ("" = top level)
    draft_subdir: str | None = None  # the EAGLE head's folder inside the package


MODELS = {
    "embedded": EmbeddedModel("embedded", "", EAGLE_DIR),
    "embedded-moe": EmbeddedModel("embedded-moe", "moe"),
}


def package_dir() -> Path:
    return Path(str(resources.files("tokenspeed.models.embedded")))


def is_embedded_model(name: str | None) -> bool:
    return name is None or name in MODELS


def _spec(name: str) -> EmbeddedModel:
    if name not in MODELS:
        raise ValueError(f"unknown embedded model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name]


def package_config(name: str, draft: bool = False) -> dict[str, Any]:
    spec = _spec(name)
    sub = spec.draft_subdir if draft else spec.subdir
    if sub is None:
        raise ValueError(f"{name} has no draft head")
    config: dict[str, Any] = json.loads((package_dir() / sub / "config.json").read_text())
    return config


def trained_weights_file(name: str, draft: bool = False) -> Path:
    spec = _spec(name)
    sub = spec.draft_subdir if draft else spec.subdir
    return package_dir() / (sub or "") / WEIGHTS_FILE


def has_trained_weights(name: str = "embedded") -> bool:
    return trained_weights_file(name).is_file()


def _cache_root() -> Path:
    env = os.environ.get("TOKENSPEED_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tokenspeed"


def _fingerprint(spec: EmbeddedModel) -> str:
    digest = hashlib.sha256(f"{_FORMAT}/{_WEIGHT_SEED}/{spec.name}".encode())
    root = package_dir()
    files = [root / a for a in TOKENIZER_ASSETS]
    for sub in (spec.subdir, spec.draft_subdir):
        if sub is not None:
            files += [root / sub / "config.json", root / sub / WEIGHTS_FILE]
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"<absent>")
    return digest.hexdigest()[:16]


def write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """bf16 safetensors (fp32 where routing needs it), in the metadata transformers expects."""
    import torch
    from safetensors.torch import save_file

    out = {
        name: t.detach().to("cpu", torch.float32 if name.endswith(_FP32_TENSORS) else torch.bfloat16)
        .contiguous()
        .clone()
        for name, t in sorted(tensors.items())
    }
    save_file(out, str(path), metadata={"format": "pt"})


def write_model_folder(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """A Hugging Face checkpoint folder: config, the embedded tokenizer and chat template, weights."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_ASSETS:
        shutil.copyfile(package_dir() / name, folder / name)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_weights(folder / WEIGHTS_FILE, tensors)


def _random_tensors(config: dict[str, Any], draft: bool) -> dict[str, torch.Tensor]:
    """Seeded random weights of the trainable network's shapes (as a fresh training run starts)."""
    import torch

    from tokenspeed.models.embedded.training.nets import build_net

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_WEIGHT_SEED)
        return build_net(config, draft=draft).hf_state_dict()  # type: ignore[operator, no-any-return]


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _full_layout(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek's MTP layout: add the MTP layer's copies of the embedding and head when absent."""
    mtp_layers = int(config.get("num_nextn_predict_layers") or 0)
    head = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    for i in range(config["num_hidden_layers"], config["num_hidden_layers"] + mtp_layers):
        tensors.setdefault(f"model.layers.{i}.embed_tokens.weight", tensors["model.embed_tokens.weight"])
        if head is not None:
            tensors.setdefault(f"model.layers.{i}.shared_head.head.weight", head)
    return tensors


def _weights(name: str, config: dict[str, Any], draft: bool) -> dict[str, torch.Tensor]:
    trained = trained_weights_file(name, draft)
    tensors = _load_tensors(trained) if trained.is_file() else _random_tensors(config, draft)
    return _full_layout(config, tensors)


def _notice_random_weights(name: str) -> None:
    """One log line per process and model that lacks trained weights (before the first training run)."""
    for draft in (False, True) if _spec(name).draft_subdir else (False,):
        path = trained_weights_file(name, draft)
        if not path.is_file() and str(path) not in _warned:
            _warned.add(str(path))
            logger.warning("%s%s: no trained weights (%s absent); using seeded random weights, "
                           "its text is not meaningful", name, " draft head" if draft else "", path)


def embedded_model_path(name: str = "embedded") -> Path:
    """The folder of embedded model `name`, built on first use (atomic: safe under concurrent first calls)."""
    spec = _spec(name)
    target = _cache_root() / f"{name}-{_fingerprint(spec)}"
    _notice_random_weights(name)
    if (target / WEIGHTS_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=target.parent))
    try:
        config = package_config(name)
        write_model_folder(staging, config, _weights(name, config, draft=False))
        if spec.draft_subdir is not None:
            draft_config = package_config(name, draft=True)
            (staging / EAGLE_DIR).mkdir()
            (staging / EAGLE_DIR / "config.json").write_text(json.dumps(draft_config, indent=2) + "\n")
            write_weights(staging / EAGLE_DIR / WEIGHTS_FILE, _weights(name, draft_config, draft=True))
        with contextlib.suppress(OSError):  # another process won the race; its folder is identical
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def embedded_eagle_path() -> Path:
    """The EAGLE draft head of the default embedded model (config.json + model.safetensors)."""
    return embedded_model_path("embedded") / EAGLE_DIR
