"""`Fp8Config`: which weights are FP8, in which blocks, and whether the checkpoint already holds them so.

Two ways in, one result:

- a checkpoint's own `quantization_config` (DeepSeek-V3/R1, Kimi-K2,
  Qwen3-*-FP8: `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
  [128, 128], "activation_scheme": "dynamic", "modules_to_not_convert": [...]}`):
  the linear weights are stored fp8 with a `weight_scale_inv` per block
  (`serialized=True`);
- `quantization="fp8"` (vLLM's `--quantization fp8`) on a bf16/fp32 checkpoint:
  every linear weight is quantised at load, one scale per output channel
  (`serialized=False`; per channel rather than per block because a channel
  never straddles the parts of a fused projection, and cuBLAS takes it).

A checkpoint's `quantization_config` is never ignored: a method other than
fp8, a format other than e4m3, static activation scales or a block that is
not 2-D are refused here, with what is supported, before anything is built.
Activations are always quantised dynamically (per token and group of 128 in
the tensor-core GEMMs, not at all in the one-token GEMV).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenspeed.errors import ModelNotSupported
from tokenspeed.kernels.quant.fp8 import GROUP_SIZE

QUANTIZATION_METHODS = ("fp8",)
# vLLM's spellings; "fp8" is e4m3 (the attention kernels read e4m3 only).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Projections a layer reads itself (absorbed into other products), never through a GEMM: dequantised at load.
ABSORBED_PROJECTIONS = ("kv_b_proj",)
# Projections FP8 checkpoints keep in bf16 without listing them: DeepSeek-V3's MTP input projection.
NEVER_FP8_PROJECTIONS = ("eh_proj",)


@dataclass(frozen=True, slots=True)
class Fp8Config:
    """FP8 weights of a model; `block_size` None: one scale per output channel (online quantisation)."""

    serialized: bool  # the checkpoint holds fp8 weights and their `weight_scale_inv`
    block_size: tuple[int, int] | None
    modules_to_not_convert: tuple[str, ...] = ()

    def skips(self, checkpoint_module: str) -> bool:
        """Whether a module (HF name, e.g. `model.layers.0.mlp.gate_proj`) stays unquantised.

        An entry matches a module whose name contains it as whole path components
        (`"lm_head"`, `"model.layers.0.self_attn"`, `"mlp.gate"`): transformers'
        substring rule, except that `mlp.gate` (a router) does not also match
        `mlp.gate_proj`, nor `layers.1` match `layers.10`.
        """
        name = f".{checkpoint_module}."
        return any(entry and f".{entry.strip('.')}." in name for entry in self.modules_to_not_convert)

    def stores_fp8(self, tensor: str) -> bool:
        """Whether a serialized checkpoint holds `tensor` (HF name) in fp8, with a `weight_scale_inv` beside it:
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


def resolve_quantization(raw: Mapping[str, Any], quantization: str | None) -> Fp8Config | None:
    """The FP8 configuration of a model from its config.json (`raw`) and the engine's `quantization`.

    Raises ModelNotSupported for a checkpoint method we cannot run, ValueError for an unknown
    `quantization`, and both disagreeing (a checkpoint quantised one way cannot be run another).
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
    if method != "fp8":
        raise ModelNotSupported(
            f"checkpoint quantization {method!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    fmt = section.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelNotSupported(f"fp8 format {fmt!r} is not supported; only e4m3")
    scheme = section.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelNotSupported(f"activation_scheme {scheme!r} is not supported; only dynamic")
    block = section.get("weight_block_size")
    if block is None:
        raise ModelNotSupported(
            "fp8 checkpoints with per-tensor weight scales are not supported; only weight_block_size [n, k]"
        )
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelNotSupported(f"weight_block_size must be two positive integers, got {block!r}")
    if block[1] % GROUP_SIZE:
        raise ModelNotSupported(
            f"weight_block_size {block}: the K block must be a multiple of {GROUP_SIZE} (the activation group)"
        )
    skipped = section.get("modules_to_not_convert") or section.get("ignored_layers") or ()
    return Fp8Config(serialized=True, block_size=(block[0], block[1]), modules_to_not_convert=tuple(skipped))


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raise ValueError for a `kv_cache_dtype` we do not store (fp8_e5m2 among them: no kernel reads it)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
