"""Put a built model's linear layers and routed experts into FP8, as its `Fp8Config` says.

Two moments around the weight load (`loader.load_weights`):

- `prepare_fp8` (before): for a serialized FP8 checkpoint every quantised
  layer gets empty fp8 weights and `weight_scale_inv` parameters (in the
  checkpoint's blocks, or one per output row for per-tensor / per-channel
  checkpoints, whose scales the loader makes per row), so the loader's usual
  name check reports a missing or unexpected scale, and its shape check a
  malformed one, as a `WeightLoadError`;
- `finish_fp8` (after): online quantisation of the loaded weights
  (`quantization="fp8"`), or, for a serialized checkpoint, dequantisation of
  the weights the model reads directly instead of through a GEMM: MLA's
  `kv_b_proj`, whose W_UK / W_UV are absorbed into the query and the output
  (`layers/mla.py`), is kept in the model dtype.

What stays unquantised: the embedding, the LM head and MoE routers (not
`Linear`s: they are bf16 in every FP8 checkpoint), DeepSeek's MTP `eh_proj`
(bf16 in V3's checkpoint, as vLLM reads it), modules the checkpoint's
`modules_to_not_convert` / `ignored_layers` / `ignore` names (HF names,
transformers' substring rule or `re:` patterns, `Fp8Config.skips`; a fused
projection must be skipped whole or not at all), and, online, `kv_b_proj`.
The decode layer's fused forms (norms in the GEMV prologues, SiLU-and-mul,
residual adds) run on the FP8 GEMV where it is the small-batch kernel, as on
bf16 weights; elsewhere (the CPU's reference) the layers take the plain path.

On several ranks each rank runs both moments on its own layers (local sizes,
its slices loaded by `models/parallel/rank_model.py`); online quantisation
then completes the amax of weights split by their input features across the
ranks (`reduce_amax_of`, see `models/parallel/fp8_sharding.py`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tokenspeed.errors import ModelNotSupported
from tokenspeed.kernels.gemm.fp8_dispatch import fits_silu_mul
from tokenspeed.layers.fp8_weights import (
    AmaxReduce,
    dequantize_in_place,
    online_block,
    restore_dtype,
    stored_block,
)
from tokenspeed.layers.linear import Linear, MergedLinear
from tokenspeed.layers.mlp import GatedMLP
from tokenspeed.layers.moe import SparseMoE
from tokenspeed.models.llama import DecoderLayer
from tokenspeed.models.quant_config import ABSORBED_PROJECTIONS, NEVER_FP8_PROJECTIONS, Fp8Config


def _hf_names(model: nn.Module, path: str, module: nn.Module) -> list[str]:
    """The checkpoint names of the modules `path` stands for (the parts of a fused one)."""
    unrenames = {ours: hf for hf, ours in getattr(model, "checkpoint_renames", {}).items()}
    hf_path = ".".join(unrenames.get(part, part) for part in path.split("."))
    if isinstance(module, MergedLinear):
        packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
        unpacked = {v: k for k, v in packed.items()}
        parent, _, leaf = hf_path.rpartition(".")
        return [f"{parent}.{unpacked.get((leaf, shard), leaf)}" for shard in module.shard_names]
    if isinstance(module, SparseMoE):
        names = module.experts.names
        first = module.experts.first_expert  # global id of this rank's first expert
        return [f"{hf_path}.experts.{first + e}.{n}" for e in range(module.experts.num_experts)
                for n in (names.gate, names.up, names.down)]
    return [hf_path]


def _targets(model: nn.Module, config: Fp8Config) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every Linear and SparseMoE that becomes fp8."""
    for path, module in model.named_modules():
        if not isinstance(module, (Linear, SparseMoE)):
            continue
        if type(module).__module__.endswith("parallel_linear"):
            raise ModelNotSupported(
                "fp8 weights are not supported in the reference parallel layers (layers/parallel_linear.py); "
                "the engine's ranks build plain layers at their local sizes"
            )
        leaf = path.rpartition(".")[2]
        if leaf in NEVER_FP8_PROJECTIONS or (not config.serialized and leaf in ABSORBED_PROJECTIONS):
            continue
        skipped = [config.skips(name) for name in _hf_names(model, path, module)]
        if all(skipped):
            continue
        if any(skipped):
            raise ModelNotSupported(
                f"modules_to_not_convert names some but not all parts of {path}; they run as one fp8 GEMM"
            )
        yield path, module


def _block_of(module: nn.Module, config: Fp8Config) -> tuple[int, int]:
    if config.block_size is None:
        return online_block()
    if isinstance(module, MergedLinear):
        return stored_block(module.part_sizes, config.block_size)
    if isinstance(module, SparseMoE):
        inter = module.experts.intermediate_size
        return stored_block([inter, inter], config.block_size)
    return config.block_size


# The amax reduction of a checkpoint weight (HF name) split by its input features over ranks, or None.
ReduceAmaxOf = Callable[[str], AmaxReduce | None]


def _use_fp8(module: nn.Module, config: Fp8Config, reduce_amax: AmaxReduce | None = None) -> None:
    checkpoint_block = config.block_size if config.serialized else None
    module.use_fp8(  # type: ignore[operator]
        _block_of(module, config), checkpoint_block=checkpoint_block, reduce_amax=reduce_amax
    )


def _row_weight(model: nn.Module, path: str, module: nn.Module) -> str:
    """The checkpoint name of the weight whose rows an online scale covers: the projection's, or for
    routed experts the first expert's down projection (the only expert weight split by its input features)."""
    names = _hf_names(model, path, module)
    if isinstance(module, SparseMoE):
        down = module.experts.names.down
        names = [name for name in names if name.endswith(f".{down}")]
    return f"{names[0]}.weight"


def _route_decode_paths(model: nn.Module) -> None:
    """The fused decode forms now run on the FP8 GEMV: each bound becomes what its fp8 kernels serve."""
    for module in model.modules():
        if isinstance(module, GatedMLP) and module.gate_up_proj.fp8_block is not None:
            gate_up = module.gate_up_proj
            fits = fits_silu_mul(*gate_up.weight.shape, gate_up.fp8_block)
            module._fused_max_tokens = gate_up.decode_max_tokens if fits and module._fused_max_tokens >= 0 else -1
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            module._fused_decode_max_tokens = module.fused_decode_limit()


def prepare_fp8(model: nn.Module, config: Fp8Config | None) -> None:
    """Before loading a serialized FP8 checkpoint: fp8 storage and scales for every quantised layer.

    The model was built under `fp8_weight_allocation` (`executor.load_model`), so every projection
    weight is fp8 already; those that stay unquantised get their model-dtype storage back here.
    """
    if config is None or not config.serialized:
        return
    targets = dict(_targets(model, config))
    for path, module in model.named_modules():
        if path in targets:
            _use_fp8(module, config)
        elif isinstance(module, Linear):
            restore_dtype(module, "weight", module._dtype)
        elif isinstance(module, SparseMoE):
            for attr in ("w13", "w2"):
                restore_dtype(module.experts, attr, module.experts.dtype)
    _route_decode_paths(model)


def finish_fp8(model: nn.Module, config: Fp8Config | None, reduce_amax_of: ReduceAmaxOf | None = None) -> None:
    """After loading: quantise online (a rank of several: `reduce_amax_of`), or dequantise the absorbed
    weights of a serialized checkpoint."""
    if config is None:
        return
    if not config.serialized:
        for path, module in list(_targets(model, config)):
            reduce = None if reduce_amax_of is None else reduce_amax_of(_row_weight(model, path, module))
            _use_fp8(module, config, reduce)
        _route_decode_paths(model)
    else:
        for path, module in model.named_modules():
            absorbed = path.rpartition(".")[2] in ABSORBED_PROJECTIONS
            if isinstance(module, Linear) and module.fp8_block is not None and absorbed:
                dtype = module._dtype
                dequantize_in_place(module, "weight", module.fp8_block, dtype)
                module.drop_fp8(module.weight.data)
    device = next(model.parameters()).device
    if device.type == "cuda":
        # the weights the fp8 ones replaced sit in the allocator's cache: give them back, or the KV
        # pool (sized from the free memory) would not get them
        gc.collect()
        torch.cuda.empty_cache()
