"""compressed-tensors checkpoints (llm-compressor's `quant_method: compressed-tensors`): which FP8 scheme, if any.

What we run is the float8 schemes the Hub's FP8 Llama / Qwen checkpoints use
(RedHatAI's *-FP8 and *-FP8-dynamic):

    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}},
      "ignore": ["lm_head", "re:.*mlp.gate$"]}

Every `Linear` but those `ignore` names (exact names, or `re:` patterns) holds
an e4m3 `weight` and its `weight_scale`: `[N, 1]` for the `channel` strategy,
`[1]` (or `[]`) for `tensor`. Static per-tensor input activations add an
`input_scale` beside each weight. A float8 `kv_cache_scheme` needs nothing
here: its `self_attn.k_scale` / `v_scale` load like any checkpoint's KV
scales (`layers/kv_scales.py`), used by an fp8 KV cache (`kv_cache_dtype`).
`naive-quantized` is the older name of the same layout and is read the same
way once the scheme says float8.

Anything else (int or 4-bit types, group / block strategies, asymmetric or
dynamic weights, output activations, groups of different schemes, targets
other than `Linear`, sparse or transformed weights, a KV cache scheme other
than float8) is refused with
ModelNotSupported naming the field and what is supported: those need kernels
and layouts the engine does not have, and loading them as float8 would give
wrong outputs without a word.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenspeed.errors import ModelNotSupported

FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("tensor", "channel")
TARGETS = ("Linear",)


@dataclass(frozen=True, slots=True)
class CompressedTensorsFp8:
    """The one float8 scheme of a compressed-tensors checkpoint, as the engine loads it."""

    per_channel: bool  # `weight_scale` [N, 1]; False: one per weight
    static_input_scales: bool  # an `input_scale` beside each fp8 weight
    ignore: tuple[str, ...]  # modules left unquantised (exact names or `re:` patterns)


def compressed_tensors_fp8(section: Mapping[str, Any]) -> CompressedTensorsFp8:
    """The FP8 scheme of a compressed-tensors `quantization_config`; ModelNotSupported for any other."""
    _check_format("format", section.get("format"))
    sparsity = section.get("sparsity_config")
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise ModelNotSupported(
            f"compressed-tensors sparsity_config format {sparsity.get('format')!r} is not supported; only dense"
        )
    if section.get("transform_config"):
        raise ModelNotSupported("compressed-tensors transform_config is not supported; only untransformed weights")
    if section.get("kv_cache_scheme") is not None:  # its k_scale / v_scale can only scale an e4m3 cache
        _strategy("kv_cache_scheme", section["kv_cache_scheme"])
    groups = section.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ModelNotSupported(f"compressed-tensors config_groups must name at least one scheme, got {groups!r}")
    schemes = {name: _scheme(f"config_groups.{name}", group) for name, group in groups.items()}
    if len(set(schemes.values())) > 1:
        raise ModelNotSupported(
            f"compressed-tensors config_groups {', '.join(schemes)} have different schemes; only one float8 scheme "
            "for every Linear is supported"
        )
    per_channel, static = next(iter(schemes.values()))
    ignore = section.get("ignore") or ()
    return CompressedTensorsFp8(per_channel=per_channel, static_input_scales=static, ignore=tuple(ignore))


def _check_format(field: str, fmt: Any) -> None:
    if fmt not in FORMATS:
        raise ModelNotSupported(
            f"compressed-tensors {field} {fmt!r} is not supported; supported: {', '.join(FORMATS)} (float8 weights)"
        )


def _scheme(where: str, group: Any) -> tuple[bool, bool]:
    """(per-channel weights, static input scales) of one config group."""
    if not isinstance(group, Mapping):
        raise ModelNotSupported(f"compressed-tensors {where} must be an object, got {group!r}")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets or any(t not in TARGETS for t in targets):
        raise ModelNotSupported(
            f"compressed-tensors {where}.targets {targets!r} is not supported; only {list(TARGETS)} (every linear "
            "layer but those in ignore)"
        )
    if "format" in group and group["format"] is not None:
        _check_format(f"{where}.format", group["format"])
    if group.get("output_activations") is not None:
        raise ModelNotSupported(f"compressed-tensors {where}.output_activations is not supported; only null")
    return _weights(f"{where}.weights", group.get("weights")), _input_scales(
        f"{where}.input_activations", group.get("input_activations")
    )


def _strategy(where: str, args: Any) -> Any:
    """The strategy of quantisation arguments `args`, after checking they describe symmetric 8-bit floats."""
    if not isinstance(args, Mapping):
        raise ModelNotSupported(f"compressed-tensors {where} must be an object of float8 arguments, got {args!r}")
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise ModelNotSupported(
            f"compressed-tensors {where}: type {args.get('type')!r} with num_bits {args.get('num_bits')!r} is not "
            "supported; only type float with num_bits 8 (FP8 e4m3)"
        )
    if args.get("symmetric", True) is not True:
        raise ModelNotSupported(f"compressed-tensors {where}.symmetric must be true (FP8 has no zero point)")
    strategy = args.get("strategy")
    if strategy is None:  # compressed-tensors' default: per tensor unless a group size says otherwise
        strategy = "group" if args.get("group_size") else "tensor"
    return strategy


def _weights(where: str, args: Any) -> bool:
    """Whether the weights have one scale per output channel (False: per tensor)."""
    strategy = _strategy(where, args)
    if strategy not in WEIGHT_STRATEGIES:
        raise ModelNotSupported(
            f"compressed-tensors {where}.strategy {strategy!r} is not supported; supported: "
            f"{', '.join(WEIGHT_STRATEGIES)}"
        )
    if args.get("dynamic", False) is not False:
        raise ModelNotSupported(f"compressed-tensors {where}.dynamic must be false: weights are stored quantised")
    return strategy == "channel"


def _input_scales(where: str, args: Any) -> bool:
    """Whether the checkpoint has static per-tensor `input_scale`s (None: weight-only or dynamic activations,
    which the engine quantises dynamically either way; see `models/quant_config.py`)."""
    if args is None:
        return False
    strategy, dynamic = _strategy(where, args), args.get("dynamic", False)
    if strategy == "token" and dynamic is True:
        return False
    if strategy == "tensor" and isinstance(dynamic, bool):
        return not dynamic
    raise ModelNotSupported(
        f"compressed-tensors {where}: strategy {strategy!r} with dynamic {dynamic!r} is not supported; supported: "
        "token (dynamic), tensor (static or dynamic)"
    )
