"""Tiny FP8 checkpoints in the published formats, made from the tiny bf16/fp32 ones, and their checks.

Every projection weight (attention, MLP, experts; not the embedding, LM head,
router or norms) is stored as float8_e4m3fn beside its scales, in one of:

- block FP8 (`to_block_fp8`), DeepSeek-V3's exact format, which
  DeepSeek-V3/R1, Kimi-K2 and Qwen3-*-FP8 publish: a float32
  `<module>.weight_scale_inv` of one entry per `weight_block_size` block
  (w = w_fp8 * scale_inv), and in config.json::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

- per-tensor or per-channel FP8 (`to_scaled_fp8`, formats `SCALED_FORMATS`):
  vLLM's `fp8` without `weight_block_size` (a scalar `weight_scale` per
  weight, and with `activation_scheme: static` a scalar `input_scale`), and
  compressed-tensors' float8 schemes as llm-compressor writes them
  (`weight_scale` `[N, 1]` per channel or `[1]` per tensor, bf16 or fp32;
  `input_scale` `[1]` for static activations). These are quantised here by
  hand (amax / 448, no engine code), so the engine's reading of them is
  checked against an independent writer.

Each writer returns the dequantised weights (w_fp8.float() * scale), which are
what transformers must run in fp32 to be the peer of the engine
(`dequantised_checkpoint`, `assert_matches_transformers`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import make_checkpoint, make_deepseek_checkpoint, prompts
from tests.multi_rank_runs import assert_same, engine, run_workloads
from tests.test_deepseek_parity import assert_matches_hf_greedy
from tokenspeed import LLM, SamplingParams
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE, dequantize_weight, quantize_weight_block

E4M3_MAX = 448.0

# One projection weight (fp32) -> (the tensors stored for it by their last name, its dequantised weight).
Quantise = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def make_source(family: str, folder: Path) -> Path:
    """The tiny fp32 checkpoint of `family` (`tests/checkpoints.py`)."""
    if family.startswith("deepseek"):
        return make_deepseek_checkpoint(family, folder)
    return make_checkpoint(family, folder)


def _is_projection(name: str) -> bool:
    """A weight the published checkpoints store in FP8; DeepSeek-V3 keeps its MTP layer's `eh_proj` in bf16."""
    module = name.removesuffix(".weight")
    leaf = module.rpartition(".")[2]
    return name.endswith(".weight") and leaf != "eh_proj" and ("_proj" in leaf or leaf in ("w1", "w2", "w3"))


def _write_fp8(
    source: Path, folder: Path, quantise: Quantise, skips: Callable[[str], bool], section: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Write `folder`: `source` with every projection not `skips` (module name) quantised, `section` its
    `quantization_config`; returns {name: dequantised fp32 weight}."""
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
        if _is_projection(name) and not skips(module):
            stored, dequantised[name] = quantise(tensor.float())
            out.update({f"{module}.{last}": value.contiguous() for last, value in stored.items()})
        else:
            out[name] = tensor.contiguous()
    save_file(out, str(folder / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = section
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return dequantised


def to_block_fp8(
    source: Path,
    folder: Path,
    *,
    block: tuple[int, int] = (128, 128),
    not_convert: tuple[str, ...] = (),
    config_extra: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `folder`: `source` with its projections in block FP8; returns {name: dequantised fp32 weight}."""

    def quantise(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, scale = quantize_weight_block(weight, block)
        return {"weight": q, "weight_scale_inv": scale}, dequantize_weight(q, scale, block)

    section = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"modules_to_not_convert": list(not_convert)} if not_convert else {}),
        **(config_extra or {}),
    }
    return _write_fp8(source, folder, quantise, lambda module: any(e in module for e in not_convert), section)


def _float8_args(strategy: str, *, dynamic: bool) -> dict[str, Any]:
    """compressed-tensors' QuantizationArgs of a float8 scheme, as llm-compressor writes them."""
    return {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": dynamic,
            "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}


def compressed_tensors_section(weights: str, input_activations: dict[str, Any] | None) -> dict[str, Any]:
    """A compressed-tensors `quantization_config` of one float8 group over every Linear (no `ignore` yet)."""
    group = {"targets": ["Linear"], "weights": _float8_args(weights, dynamic=False),
             "input_activations": input_activations, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "kv_cache_scheme": None}


@dataclass(frozen=True, slots=True)
class ScaledFp8Format:
    """A per-tensor / per-channel FP8 checkpoint format, as `to_scaled_fp8` writes it."""

    section: dict[str, Any]  # quantization_config, less its list of unquantised modules
    ignore_key: str  # where that list goes: vLLM's `ignored_layers`, compressed-tensors' `ignore`
    per_channel: bool  # weight_scale [N, 1]; else one per weight, of shape `scalar_shape`
    static_input_scales: bool
    scalar_shape: tuple[int, ...]
    scale_dtype: torch.dtype = torch.float32


SCALED_FORMATS = {
    "fp8_static": ScaledFp8Format({"quant_method": "fp8", "activation_scheme": "static"}, "ignored_layers",
                                  per_channel=False, static_input_scales=True, scalar_shape=()),
    "fp8_dynamic": ScaledFp8Format({"quant_method": "fp8", "activation_scheme": "dynamic"}, "ignored_layers",
                                   per_channel=False, static_input_scales=False, scalar_shape=()),
    # RedHatAI's *-FP8-dynamic: channel weights (scales in bf16, as the model), dynamic per-token activations
    "ct_channel": ScaledFp8Format(compressed_tensors_section("channel", _float8_args("token", dynamic=True)),
                                  "ignore", per_channel=True, static_input_scales=False, scalar_shape=(1,),
                                  scale_dtype=torch.bfloat16),
    # RedHatAI's *-FP8: per-tensor weights and static per-tensor activations
    "ct_tensor": ScaledFp8Format(compressed_tensors_section("tensor", _float8_args("tensor", dynamic=False)),
                                 "ignore", per_channel=False, static_input_scales=True, scalar_shape=(1,)),
}
INPUT_SCALE = 0.02  # what a calibration would have found; the engine checks it and quantises dynamically


def _ignored(module: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors' rule (vLLM's for exact `ignored_layers` names too): the module's exact name, or a
    `re:` pattern matching from its start."""
    return any(re.match(e[3:], module) if e.startswith("re:") else e == module for e in ignore)


def to_scaled_fp8(source: Path, folder: Path, fmt: str, ignore: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Write `folder`: `source` in per-tensor / per-channel FP8 format `fmt` (`SCALED_FORMATS`), the modules
    `ignore` names left unquantised; returns {name: dequantised fp32 weight}."""
    spec = SCALED_FORMATS[fmt]

    def quantise(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        amax = weight.abs().amax(dim=1, keepdim=True) if spec.per_channel else weight.abs().amax().reshape(1, 1)
        scale = (amax.clamp(min=1e-12) / E4M3_MAX).to(spec.scale_dtype)
        q = (weight / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
        stored = {"weight": q, "weight_scale": scale if spec.per_channel else scale.reshape(spec.scalar_shape)}
        if spec.static_input_scales:
            stored["input_scale"] = torch.full(spec.scalar_shape, INPUT_SCALE)
        return stored, q.float() * scale.float()

    section = {**spec.section, spec.ignore_key: list(ignore)}
    return _write_fp8(source, folder, quantise, lambda module: _ignored(module, ignore), section)


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


def rewrite_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Apply `change` to the tensors of `folder`'s single-file checkpoint, in place (malformed checkpoints)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def assert_matches_transformers(llm: LLM, hf: Any, what: str) -> None:
    """Greedy tokens of `llm` identical to transformers' (`hf`) on four prompts, top-2 logprobs within 1e-4."""
    batch = prompts(4, seed=5, min_len=5, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    for prompt, output in zip(batch, outputs):
        assert_matches_hf_greedy(hf, prompt, output.outputs[0], what)


def fp8_parameters(llm: LLM) -> dict[str, int]:
    """The fp8 parameters of the engine's model (rank 0's on several ranks; names as on one rank), and sizes."""
    executor = llm.core.executor  # type: ignore[attr-defined]
    model = getattr(executor, "local", executor).model
    return {
        name.removeprefix("inner."): p.numel() for name, p in model.named_parameters() if p.dtype == FP8_DTYPE
    }


def assert_two_ranks_match_one(case: str, folder: Path, ep: bool, dp_attention: bool = False,
                               **options: Any) -> dict[str, int]:
    """One rank's and two ranks' tokens and logprobs on `folder` are the same, and rank 0 holds the same layers
    in fp8 as one rank, but only its share of their weights; rank 0's fp8 parameters, for further checks."""
    results, fp8 = {}, {}
    for tp in (1, 2):
        llm = engine(folder, tp, ep, dp_attention, **options)
        try:
            results[tp] = run_workloads(llm)
            fp8[tp] = fp8_parameters(llm)
        finally:
            llm.shutdown()
    assert_same(case, results[1], results[2])
    assert fp8[1] and fp8[2].keys() == fp8[1].keys(), "rank 0 must hold the same layers in fp8 as one rank"
    assert sum(fp8[2].values()) < sum(fp8[1].values()), "rank 0 must hold only its share of the fp8 weights"
    return fp8[2]
