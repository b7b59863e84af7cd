"""Weight loading: HF safetensors checkpoints (single file or sharded) and dummy weights.

Names are checked before any tensor is read: safetensors headers are cheap, so
a checkpoint that does not fit the model (missing or unexpected tensors)
fails in a second with every offending name, not after minutes of copying.
Tensors are then streamed one at a time into the model's parameters, which
keeps host memory at one tensor regardless of model size.

HF names map one-to-one onto ours except for fused projections, which the
model declares in `packed_modules` (e.g. `q_proj` -> shard `q` of `qkv_proj`).

Dummy weights (`load_format="dummy"`) let the engine be benchmarked and
tested at real shapes without files: normal(0, 0.02) from a seed, norms at 1.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from tokenspeed.errors import TokenSpeedError
from tokenspeed.layers.norm import RMSNorm

logger = logging.getLogger("tokenspeed.models")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DUMMY_STD = 0.02
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
_MAX_NAMES_SHOWN = 12


class WeightLoadError(TokenSpeedError, ValueError):
    """The checkpoint does not match the model, or has no weights we can read."""


@dataclass(frozen=True, slots=True)
class _Target:
    param: str  # our parameter name
    shard: str | None  # shard id inside a fused parameter, None for a whole parameter


def load_weights(
    model: nn.Module,
    folder: str | Path | None,
    load_format: str = "auto",
    seed: int = 0,
    progress: bool = False,
) -> None:
    """Fill `model`'s parameters from `folder` (safetensors) or with seeded random values ("dummy")."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "dummy":
        load_dummy_weights(model, seed=seed)
        return
    if folder is None:
        raise WeightLoadError("no checkpoint folder given; use load_format='dummy' for random weights")
    files = find_weight_files(Path(folder))
    _load_safetensors(model, files, progress=progress)


def find_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: from the shard index, else the single file."""
    if not folder.is_dir():
        raise WeightLoadError(f"checkpoint folder {folder} does not exist")
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightLoadError(f"{index} lists shards that are missing: {', '.join(absent)}")
        if not files:
            raise WeightLoadError(f"{index} has an empty weight_map")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    # Shards without an index (hand-made checkpoints); `consolidated.*` is Mistral's other format.
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if files:
        return files
    raise WeightLoadError(
        f"no safetensors weights in {folder} (looked for {INDEX_FILE}, {SINGLE_FILE}, *.safetensors); "
        "PyTorch .bin checkpoints are not supported"
    )


def _resolve(model: nn.Module, name: str) -> _Target | None:
    """Our target for checkpoint tensor `name`, or None when the tensor is deliberately ignored."""
    if name.endswith(_SKIPPED_SUFFIXES):
        return None
    if name == "lm_head.weight" and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return None  # tied: the embedding matrix is the head
    module_path, _, attr = name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    if leaf in packed:
        fused, shard = packed[leaf]
        return _Target(f"{parent}.{fused}.{attr}" if parent else f"{fused}.{attr}", shard)
    return _Target(name, None)


def _expected_targets(model: nn.Module) -> dict[_Target, str]:
    """Every (parameter, shard) the checkpoint must provide -> its name in HF spelling (for errors)."""
    unpacked = {v: k for k, v in getattr(model, "packed_modules", {}).items()}
    expected: dict[_Target, str] = {}
    for name, _ in model.named_parameters():
        module_path, _, attr = name.rpartition(".")
        module = model.get_submodule(module_path)
        shards: tuple[str, ...] = getattr(module, "shard_names", ())
        if not shards:
            expected[_Target(name, None)] = name
            continue
        parent, _, leaf = module_path.rpartition(".")
        for shard in shards:
            hf_leaf = unpacked.get((leaf, shard), f"{leaf}[{shard}]")
            expected[_Target(name, shard)] = f"{parent}.{hf_leaf}.{attr}"
    return expected


def _shown(names: list[str]) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - _MAX_NAMES_SHOWN} more)" if len(names) > _MAX_NAMES_SHOWN else ""
    return ", ".join(names[:_MAX_NAMES_SHOWN]) + more


def _plan(model: nn.Module, files: list[Path]) -> dict[Path, list[tuple[str, _Target]]]:
    """Map every checkpoint tensor to its target, raising on any missing or unexpected name."""
    expected = _expected_targets(model)
    plan: dict[Path, list[tuple[str, _Target]]] = {}
    seen: set[_Target] = set()
    unexpected: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
        entries = plan.setdefault(path, [])
        for name in names:
            target = _resolve(model, name)
            if target is None:
                continue
            if target not in expected:
                unexpected.append(name)
                continue
            seen.add(target)
            entries.append((name, target))
    missing = [hf for target, hf in expected.items() if target not in seen]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_shown(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_shown(unexpected)}")
    if problems:
        architecture = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
        folder = files[0].parent
        raise WeightLoadError(f"checkpoint {folder} does not match {architecture}: " + "; ".join(problems))
    return plan


def _load_safetensors(model: nn.Module, files: list[Path], *, progress: bool) -> None:
    plan = _plan(model, files)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for path in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=not progress):
            with safe_open(str(path), framework="pt") as f:
                for name, target in plan[path]:
                    _copy_into(model, params, target, name, f.get_tensor(name))


def _copy_into(
    model: nn.Module, params: dict[str, nn.Parameter], target: _Target, source: str, tensor: torch.Tensor
) -> None:
    if target.shard is not None:
        module_path, _, attr = target.param.rpartition(".")
        try:
            model.get_submodule(module_path).load_shard(attr, target.shard, tensor)  # type: ignore[operator]
        except ValueError as error:
            raise WeightLoadError(f"{source}: {error}") from None
        return
    param = params[target.param]
    if tuple(param.shape) != tuple(tensor.shape):
        raise WeightLoadError(
            f"{source}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}"
        )
    param.data.copy_(tensor)


def _norm_parameters(model: nn.Module) -> set[str]:
    return {
        f"{module_name}.{param_name}" if module_name else param_name
        for module_name, module in model.named_modules()
        if isinstance(module, RMSNorm)
        for param_name, _ in module.named_parameters(recurse=False)
    }


def load_dummy_weights(model: nn.Module, *, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Seeded random weights: normal(0, std) everywhere, norm weights exactly 1.

    Deterministic for a given seed, model and device type (each parameter is
    drawn on its own device from a generator seeded by `seed`).
    """
    norms = _norm_parameters(model)
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name in norms:
                param.data.fill_(1.0)
                continue
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.data.normal_(mean=0.0, std=std, generator=gen)


def describe_parameters(model: nn.Module) -> dict[str, Any]:
    """Parameter count and bytes, for logs and `tokenspeed env`."""
    params = list(model.parameters())
    return {
        "parameters": sum(p.numel() for p in params),
        "bytes": sum(p.numel() * p.element_size() for p in params),
    }
