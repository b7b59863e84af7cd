"""`Fp8Config`: which weights are FP8, how the checkpoint scales them, and whether it already holds them so.

Three ways in, one result:

- a block-FP8 checkpoint's `quantization_config` (DeepSeek-V3/R1, Kimi-K2,
  Qwen3-*-FP8: `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
  [128, 128], "activation_scheme": "dynamic", "modules_to_not_convert": [...]}`):
  the linear weights are stored fp8 with a `weight_scale_inv` per block
  (`serialized=True`, `WeightScales.BLOCK`);
- a per-tensor or per-channel FP8 checkpoint: vLLM's `fp8` without
  `weight_block_size` (`{"quant_method": "fp8", "activation_scheme":
  "static" | "dynamic", "ignored_layers": [...]}`: one `weight_scale` per
  weight) or compressed-tensors' float8 schemes (`models/compressed_tensors.py`:
  one `weight_scale` per weight or per output channel), e.g. RedHatAI's
  Llama-3.1-*-FP8(-dynamic) and Qwen3-*-FP8-dynamic. The loader turns each
  weight's scales into one per output row (a per-tensor scale repeated over
  its weight's rows: the same weight, exactly), so these run on the path of
  online quantisation below, and fused projections (q/k/v, gate/up, stacked
  experts) simply hold each part's rows with their own scales;
- `quantization="fp8"` (vLLM's `--quantization fp8`) on a bf16/fp32 checkpoint:
  every linear weight is quantised at load, one scale per output channel
  (`serialized=False`; per channel rather than per block because a channel
  never straddles the parts of a fused projection, and cuBLAS takes it).

A checkpoint's `quantization_config` is never ignored: a method or scheme we
cannot run (another method, e5m2, static activations with blocks, int or
asymmetric compressed-tensors schemes, ...) is refused here, naming the field
and what is supported, before anything is built.

Activations are always quantised dynamically (per token and group of 128 in
the tensor-core GEMMs, not at all in the one-token GEMV). A checkpoint
calibrated for static activation scales (`activation_scheme: static`, or
compressed-tensors' static per-tensor input activations) has its
`input_scale`s read and checked (one positive finite number each) but not
used: as in vLLM running such a checkpoint on a dynamic kernel, outputs may
differ slightly from an engine that applies the static scales. Likewise a
weight-only compressed-tensors scheme (no input activations) runs with
dynamically quantised activations.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tokenspeed.errors import ModelNotSupported
from tokenspeed.kernels.quant.fp8 import GROUP_SIZE, PER_CHANNEL_BLOCK
from tokenspeed.layers.fp8_weights import SCALE_SUFFIX
from tokenspeed.models.compressed_tensors import compressed_tensors_fp8

QUANTIZATION_METHODS = ("fp8",)
CHECKPOINT_METHODS = ("fp8", "compressed-tensors")
ACTIVATION_SCHEMES = ("dynamic", "static")
# vLLM's spellings; "fp8" is e4m3 (the attention kernels read e4m3 only).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Projections a layer reads itself (absorbed into other products), never through a GEMM: dequantised at load.
ABSORBED_PROJECTIONS = ("kv_b_proj",)
# Projections FP8 checkpoints keep in bf16 without listing them: DeepSeek-V3's MTP input projection.
NEVER_FP8_PROJECTIONS = ("eh_proj",)
# A static activation scale beside an fp8 weight (`X.input_scale`): read, checked, unused.
INPUT_SCALE = "input_scale"


class WeightScales(Enum):
    """How a serialized checkpoint scales its fp8 weights (w = w_fp8 * scale)."""

    BLOCK = "block"  # `weight_scale_inv`, one per `weight_block_size` block
    CHANNEL = "channel"  # `weight_scale` [N, 1], one per output row
    TENSOR = "tensor"  # `weight_scale` [] or [1], one per weight

    @property
    def suffix(self) -> str:
        """What a weight's name (`X.weight`) takes to name its scales (`X.weight_scale_inv` / `X.weight_scale`)."""
        return SCALE_SUFFIX if self is WeightScales.BLOCK else "_scale"


@dataclass(frozen=True, slots=True)
class Fp8Config:
    """FP8 weights of a model.

    `block_size`: the block of the scales the layers load, None for online quantisation (one scale per
    output channel, computed at load). A block-FP8 checkpoint's own block; `PER_CHANNEL_BLOCK` for a
    per-tensor or per-channel checkpoint (the loader hands the layers one scale per row).
    """

    serialized: bool  # the checkpoint holds fp8 weights and their scales
    block_size: tuple[int, int] | None
    modules_to_not_convert: tuple[str, ...] = ()
    weight_scales: WeightScales = WeightScales.BLOCK
    static_input_scales: bool = False  # the checkpoint has an `input_scale` beside each fp8 weight

    def skips(self, checkpoint_module: str) -> bool:
        """Whether a module (HF name, e.g. `model.layers.0.mlp.gate_proj`) stays unquantised.

        An entry matches a module whose name contains it as whole path components
        (`"lm_head"`, `"model.layers.0.self_attn"`, `"mlp.gate"`): transformers'
        substring rule, except that `mlp.gate` (a router) does not also match
        `mlp.gate_proj`, nor `layers.1` match `layers.10`. An entry `re:PATTERN`
        (compressed-tensors' `ignore`) matches where the pattern matches from the
        name's start (`re:.*mlp.gate$`).
        """
        name = f".{checkpoint_module}."
        for entry in self.modules_to_not_convert:
            if entry.startswith("re:"):
                if re.match(entry[3:], checkpoint_module):
                    return True
            elif entry and f".{entry.strip('.')}." in name:
                return True
        return False

    def stores_fp8(self, tensor: str) -> bool:
        """Whether a serialized checkpoint holds `tensor` (HF name) in fp8, with its scales beside it:
        the projection weights (`*_proj`, Mixtral's `w1`/`w2`/`w3`) but DeepSeek's MTP `eh_proj` and those
        `modules_to_not_convert` names."""
        module, _, param = tensor.rpartition(".")
        leaf = module.rpartition(".")[2]
        projection = "_proj" in leaf or leaf in ("w1", "w2", "w3")
        return (self.serialized and param == "weight" and projection and leaf not in NEVER_FP8_PROJECTIONS
                and not self.skips(module))

    def keeps_fp8(self, tensor: str) -> bool:
        """`stores_fp8`, less MLA's `kv_b_proj`: dequantised at load to be absorbed (`models/fp8_model.py`)."""
        return self.stores_fp8(tensor) and tensor.split(".")[-2] not in ABSORBED_PROJECTIONS

    def weight_of_scale(self, tensor: str) -> str | None:
        """`X.weight` for this checkpoint's scales of it (`X.weight_scale_inv` / `X.weight_scale`), else None."""
        suffix = self.weight_scales.suffix
        if not self.serialized or not tensor.endswith("weight" + suffix):
            return None
        return tensor.removesuffix(suffix)

    def weight_of_row_scales(self, tensor: str) -> str | None:
        """`X.weight` for a per-tensor / per-channel checkpoint's `X.weight_scale`, which loads as one scale per
        row of `X.weight` (`loader.scales_per_row`); None for any other tensor (block scales load as stored)."""
        return None if self.weight_scales is WeightScales.BLOCK else self.weight_of_scale(tensor)

    def scale_of(self, weight: str) -> str:
        """The checkpoint name of the scales of `weight` (`X.weight`)."""
        return weight + self.weight_scales.suffix

    def reads_input_scale(self, tensor: str) -> bool:
        """Whether `tensor` is a static activation scale beside an fp8 weight (`X.input_scale`): checked, unused."""
        module, _, param = tensor.rpartition(".")
        return self.static_input_scales and param == INPUT_SCALE and self.stores_fp8(f"{module}.weight")


def resolve_quantization(raw: Mapping[str, Any], quantization: str | None) -> Fp8Config | None:
    """The FP8 configuration of a model from its config.json (`raw`) and the engine's `quantization`.

    Raises ModelNotSupported for a checkpoint method or scheme we cannot run, ValueError for an
    unknown `quantization`. A checkpoint's own quantization wins over `quantization`.
    """
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None), got {quantization!r}"
        )
    section = raw.get("quantization_config")
    if section is None:
        return Fp8Config(serialized=False, block_size=None) if quantization == "fp8" else None
    if not isinstance(section, Mapping):
        raise ModelNotSupported(f"quantization_config must be an object, got {section!r}")
    method = section.get("quant_method")
    if method == "fp8":
        return _fp8_checkpoint(section)
    if method == "compressed-tensors":
        scheme = compressed_tensors_fp8(section)
        return Fp8Config(serialized=True, block_size=PER_CHANNEL_BLOCK, modules_to_not_convert=scheme.ignore,
                         weight_scales=WeightScales.CHANNEL if scheme.per_channel else WeightScales.TENSOR,
                         static_input_scales=scheme.static_input_scales)
    raise ModelNotSupported(
        f"checkpoint quantization {method!r} is not supported; supported: {', '.join(CHECKPOINT_METHODS)} "
        "(float8 schemes)"
    )


def _fp8_checkpoint(section: Mapping[str, Any]) -> Fp8Config:
    """vLLM's `fp8` method: 2-D weight blocks (`weight_block_size`), else one scale per weight."""
    fmt = section.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelNotSupported(f"fp8 format {fmt!r} is not supported; only e4m3")
    scheme = section.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        raise ModelNotSupported(
            f"activation_scheme {scheme!r} is not supported; supported: {', '.join(ACTIVATION_SCHEMES)}"
        )
    skipped = tuple(section.get("modules_to_not_convert") or section.get("ignored_layers") or ())
    block = section.get("weight_block_size")
    if block is None:
        return Fp8Config(serialized=True, block_size=PER_CHANNEL_BLOCK, modules_to_not_convert=skipped,
                         weight_scales=WeightScales.TENSOR, static_input_scales=scheme == "static")
    if scheme != "dynamic":
        raise ModelNotSupported(
            f"activation_scheme {scheme!r} with weight_block_size is not supported; only dynamic"
        )
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelNotSupported(f"weight_block_size must be two positive integers, got {block!r}")
    if block[1] % GROUP_SIZE:
        raise ModelNotSupported(
            f"weight_block_size {block}: the K block must be a multiple of {GROUP_SIZE} (the activation group)"
        )
    return Fp8Config(serialized=True, block_size=(block[0], block[1]), modules_to_not_convert=skipped)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raise ValueError for a `kv_cache_dtype` we do not store (fp8_e5m2 among them: no kernel reads it)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
