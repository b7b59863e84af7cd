"""Tiny block-FP8 checkpoints in DeepSeek-V3's exact format, made from the tiny bf16/fp32 ones.

What DeepSeek-V3/R1, Kimi-K2 and Qwen3-*-FP8 publish: every projection weight
(attention, MLP, experts; not the embedding, LM head, router or norms) stored
as float8_e4m3fn with a float32 `<module>.weight_scale_inv` of one entry per
`weight_block_size` block (w = w_fp8 * scale_inv), and in config.json::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

`to_block_fp8` quantises a checkpoint so and returns the dequantised weights,
which are what transformers must run to be the peer of the engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tokenspeed.kernels.quant.fp8 import dequantize_weight, quantize_weight_block


def _is_projection(name: str) -> bool:
    """A weight the published checkpoints store in FP8; DeepSeek-V3 keeps its MTP layer's `eh_proj` in bf16."""
    module = name.removesuffix(".weight")
    leaf = module.rpartition(".")[2]
    return name.endswith(".weight") and leaf != "eh_proj" and ("_proj" in leaf or leaf in ("w1", "w2", "w3"))


def to_block_fp8(
    source: Path,
    folder: Path,
    *,
    block: tuple[int, int] = (128, 128),
    not_convert: tuple[str, ...] = (),
    config_extra: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `folder`: `source` with its projections in block FP8; returns {name: dequantised fp32 weight}."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy(item, folder / item.name)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    out: dict[str, torch.Tensor] = {}
    dequantised: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if _is_projection(name) and not any(entry in module for entry in not_convert):
            q, scale = quantize_weight_block(tensor.float(), block)
            out[name] = q.contiguous()
            out[f"{module}.weight_scale_inv"] = scale.contiguous()
            dequantised[name] = dequantize_weight(q, scale, block)
        else:
            out[name] = tensor.contiguous()
    save_file(out, str(folder / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"modules_to_not_convert": list(not_convert)} if not_convert else {}),
        **(config_extra or {}),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return dequantised


def dequantised_checkpoint(source: Path, dequantised: dict[str, torch.Tensor], folder: Path) -> Path:
    """`source` with the dequantised weights in place of its own (plain fp32, for transformers)."""
    shutil.copytree(source, folder)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
        (folder / path.name).unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    tensors.update(dequantised)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
