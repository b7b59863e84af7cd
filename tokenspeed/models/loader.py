"""Weight loading: HF safetensors checkpoints (single file or sharded) and dummy weights.

Names are checked before any tensor is read: safetensors headers are cheap, so
a checkpoint that does not fit the model (missing or unexpected tensors)
fails in a second with every offending name, not after minutes of copying.
Tensors are then streamed one at a time into the model's parameters, which
keeps host memory at one tensor regardless of model size.

HF names map one-to-one onto ours except where the model declares otherwise:
fused projections in `packed_modules` (e.g. `q_proj` -> shard `q` of
`qkv_proj`), renamed path components in `checkpoint_renames`, and modules
that resolve the names below them (stacked MoE experts: per-expert tensors
`experts.{e}.gate_proj.weight` -> shard `{e}.gate` of `experts.w13`); see `_NameMap`.

Dummy weights (`load_format="dummy"`) let the engine be benchmarked and
tested at real shapes without files: normal(0, 0.02) from a seed, norms at 1.

FP8 weights (`models/fp8_model.py` gives the layers fp8 storage and
`weight_scale_inv` parameters first): scales load like any parameter, so a
missing one is a missing tensor and a malformed one a shape mismatch; an
fp8 tensor for a non-fp8 parameter (or the reverse) is refused, never cast.
A per-tensor or per-channel checkpoint's `X.weight_scale` is loaded as the
layer's `weight_scale_inv` with one scale per row of `X.weight`
(`scales_per_row`: a per-tensor scale repeated over the rows, which needs the
weight's shape from the headers), after checking that its shape fits and
every scale is positive and finite. Static activation scales (`X.input_scale`
beside an fp8 weight) are optional, checked and unused (`models/quant_config.py`).
Dummy fp8 weights are normal(0, 0.02) quantised with their own scales.

KV cache scales (`self_attn.k_scale` / `v_scale` / `kv_scale`, per tensor or
per KV head) are optional: where a checkpoint has them they go to the layer's `KVScales`
(`layers/kv_scales.py`, which checks them), never into a parameter.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from tokenspeed.errors import TokenSpeedError
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE
from tokenspeed.layers.fp8_weights import SCALE_SUFFIX, fill_dummy, per_channel_scales, per_tensor_scale
from tokenspeed.layers.kv_scales import CHECKPOINT_SCALES, KVScales
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.models.quant_config import Fp8Config, WeightScales

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
    activation_scale: bool = False  # a static `input_scale`: checked, held nowhere


def load_weights(
    model: nn.Module,
    folder: str | Path | None,
    load_format: str = "auto",
    seed: int = 0,
    progress: bool = False,
    fp8: Fp8Config | None = None,
) -> None:
    """Fill `model`'s parameters from `folder` (safetensors) or with seeded random values ("dummy");
    `fp8`: how the checkpoint names and scales its fp8 weights (`prepare_fp8` made the layers for it)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "dummy":
        load_dummy_weights(model, seed=seed)
        return
    if folder is None:
        raise WeightLoadError("no checkpoint folder given; use load_format='dummy' for random weights")
    files = find_weight_files(Path(folder))
    _load_safetensors(model, files, progress=progress, fp8=fp8)


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of `files`, from the headers alone."""
    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in list(f.keys()):
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def scales_per_row(
    fp8: Fp8Config | None, name: str, tensor: torch.Tensor, shapes: dict[str, tuple[int, ...]]
) -> torch.Tensor:
    """Checkpoint tensor `name` as the layers load it: a per-tensor / per-channel checkpoint's weight scales one
    per row of their weight (of shape `shapes[weight]`, `Fp8Config.weight_of_row_scales`); any other tensor as
    it is. WeightLoadError naming the tensor for scales that do not fit their weight."""
    weight = None if fp8 is None else fp8.weight_of_row_scales(name)
    if fp8 is None or weight is None:
        return tensor
    try:
        return per_channel_scales(tensor, shapes[weight][0], per_tensor=fp8.weight_scales is WeightScales.TENSOR)
    except ValueError as error:
        raise WeightLoadError(f"{name}: {error}") from None


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


@runtime_checkable
class CheckpointMappedModule(Protocol):
    """A module that maps the checkpoint names below it onto its own parameters (stacked MoE experts).

    `rest` is a checkpoint name relative to the module (`"3.gate_proj.weight"`);
    shard ids are the module's own and only ever come back to it.
    """

    def resolve_checkpoint_name(self, rest: str) -> tuple[str, str | None] | None:
        """(parameter, shard or None for the whole parameter), or None for a name that is not ours."""
        ...

    def checkpoint_shards(self, attr: str) -> tuple[str, ...]:
        """The shards parameter `attr` is loaded in; () when it is loaded whole."""
        ...

    def checkpoint_name(self, attr: str, shard: str) -> str:
        """The checkpoint name (relative to the module) of one shard, for error messages."""
        ...

    def load_shard(self, attr: str, shard: str, tensor: torch.Tensor) -> None:
        """Copy one shard in; raise ValueError on a shape mismatch."""
        ...


class _NameMap:
    """How checkpoint tensor names map onto `model`'s parameters, in both directions (built once per load).

    Three declarations on the model drive it, so new architectures never edit
    the loader: `packed_modules` (HF module -> our fused module and shard),
    `checkpoint_renames` (HF path component -> ours, e.g. Mixtral's
    `block_sparse_moe` -> `mlp`, the rename transformers v5 makes too), and
    modules that map the names below them themselves (`CheckpointMappedModule`:
    stacked MoE experts). An FP8 checkpoint (`fp8`) names a weight's scales its
    own way (`X.weight_scale_inv` or `X.weight_scale`): either is the layer's
    `weight_scale_inv`.
    """

    def __init__(self, model: nn.Module, fp8: Fp8Config | None = None) -> None:
        self.model = model
        self.fp8 = fp8
        self.packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
        self.unpacked = {v: k for k, v in self.packed.items()}
        self.renames: dict[str, str] = dict(getattr(model, "checkpoint_renames", {}))
        self.unrenames = {ours: hf for hf, ours in self.renames.items()}
        config = getattr(model, "config", None)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.mapped = {n: m for n, m in model.named_modules() if isinstance(m, CheckpointMappedModule)}
        self.kv_scales = {f"{n}.{scale}" for n, m in model.named_modules() if isinstance(m, KVScales)
                          for scale in CHECKPOINT_SCALES}  # optional: most checkpoints have none

    def is_optional(self, target: _Target) -> bool:
        """Whether `target` is a scale a checkpoint may or may not have: an attention layer's KV cache
        scale (loaded by `KVScales.load`) or a static activation scale (checked, unused)."""
        return target.param in self.kv_scales or target.activation_scale

    @staticmethod
    def _rename(name: str, table: dict[str, str]) -> str:
        return ".".join(table.get(part, part) for part in name.split(".")) if table else name

    def resolve(self, name: str) -> _Target | None:
        """Our target for checkpoint tensor `name`, or None when the tensor is deliberately ignored."""
        if name.endswith(_SKIPPED_SUFFIXES):
            return None
        if name == "lm_head.weight" and self.tied:
            return None  # tied: the embedding matrix is the head
        if self.fp8 is not None:
            if self.fp8.reads_input_scale(name):
                return _Target(name, None, activation_scale=True)
            weight = self.fp8.weight_of_scale(name)
            if weight is not None:
                name = weight + SCALE_SUFFIX
        name = self._rename(name, self.renames)
        module_path, _, attr = name.rpartition(".")
        kv_scale = f"{module_path}.kv_scales.{attr}"  # `self_attn.k_scale` -> its KVScales
        if kv_scale in self.kv_scales:
            return _Target(kv_scale, None)
        prefix = name
        while self.mapped and "." in prefix:
            prefix = prefix.rpartition(".")[0]
            module = self.mapped.get(prefix)
            if module is not None:
                resolved = module.resolve_checkpoint_name(name[len(prefix) + 1 :])
                if resolved is None:
                    return _Target(name, None)  # no such parameter: reported as unexpected
                mapped_attr, shard = resolved
                return _Target(f"{prefix}.{mapped_attr}", shard)
        parent, _, leaf = module_path.rpartition(".")
        if leaf in self.packed:
            fused, shard = self.packed[leaf]
            return _Target(f"{parent}.{fused}.{attr}" if parent else f"{fused}.{attr}", shard)
        return _Target(name, None)

    def expected(self) -> dict[_Target, str]:
        """Every (parameter, shard) the checkpoint must provide -> its name in HF spelling (for errors)."""
        expected: dict[_Target, str] = {}
        for name, _ in self.model.named_parameters():
            module_path, _, attr = name.rpartition(".")
            module = self.model.get_submodule(module_path)
            if isinstance(module, CheckpointMappedModule):
                shards: tuple[str, ...] = module.checkpoint_shards(attr)
            else:
                shards = getattr(module, "shard_names", ())
            if not shards:
                expected[_Target(name, None)] = self._checkpoint_name(name)
                continue
            parent, _, leaf = module_path.rpartition(".")
            for shard in shards:
                if isinstance(module, CheckpointMappedModule):
                    hf = f"{module_path}.{module.checkpoint_name(attr, shard)}"
                else:
                    hf = f"{parent}.{self.unpacked.get((leaf, shard), f'{leaf}[{shard}]')}.{attr}"
                expected[_Target(name, shard)] = self._checkpoint_name(hf)
        return expected

    def _checkpoint_name(self, ours: str) -> str:
        """A parameter name (of ours or of an unpacked part) in the checkpoint's spelling."""
        hf = self._rename(ours, self.unrenames)
        if self.fp8 is not None and hf.endswith("weight" + SCALE_SUFFIX):
            return self.fp8.scale_of(hf.removesuffix(SCALE_SUFFIX))
        return hf


def _shown(names: list[str]) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - _MAX_NAMES_SHOWN} more)" if len(names) > _MAX_NAMES_SHOWN else ""
    return ", ".join(names[:_MAX_NAMES_SHOWN]) + more


def _plan(
    model: nn.Module, files: list[Path], name_map: _NameMap
) -> tuple[dict[Path, list[tuple[str, _Target]]], list[str]]:
    """Map every checkpoint tensor to its target, raising on any missing or unexpected name.

    A whole tensor for a parameter that is normally loaded in shards (v5's stacked
    `experts.gate_up_proj`) provides every one of its shards at once. Optional
    modules (`optional_checkpoint_modules`) of which the checkpoint has no tensor
    at all are returned for dropping instead of reported missing; one that is only
    partly present is still an error.
    """
    match = TensorMatch(name_map)
    shards_of: dict[str, list[_Target]] = {}
    for wanted in match.expected:
        if wanted.shard is not None:
            shards_of.setdefault(wanted.param, []).append(wanted)
    plan: dict[Path, list[tuple[str, _Target]]] = {}
    whole: set[_Target] = set()  # shards filled by a whole tensor
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
        entries = plan.setdefault(path, [])
        for name in names:
            target = name_map.resolve(name)
            if target is None:
                continue
            if target.shard is None and target.param in shards_of:
                whole.update(shards_of[target.param])
                entries.append((name, target))
            elif match.accept(name, target):
                entries.append((name, target))
    filled = whole | match.source_of.keys()
    absent = [
        prefix
        for prefix in _optional_modules(model)
        if not any(t.param.startswith(prefix + ".") for t in filled)
    ]
    problems = match.problems(lambda t: t in whole or any(t.param.startswith(p + ".") for p in absent))
    if problems:
        architecture = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
        folder = files[0].parent
        raise WeightLoadError(f"checkpoint {folder} does not match {architecture}: " + "; ".join(problems))
    return plan, absent


class TensorMatch:
    """Checkpoint tensors matched to a model's targets, at most one tensor a target: what a loader (of one
    device, or of a rank's part) then reports as missing, unexpected, or loading one parameter twice."""

    def __init__(self, name_map: _NameMap) -> None:
        self.name_map = name_map
        self.expected = name_map.expected()
        self.source_of: dict[_Target, str] = {}  # which checkpoint tensor fills each target
        self.unexpected: list[str] = []
        self.duplicates: list[str] = []

    def accept(self, name: str, target: _Target) -> bool:
        """Whether checkpoint tensor `name` loads into `target`: one the model expects (or an optional scale)
        that no other tensor fills; otherwise it is recorded as unexpected or duplicate."""
        if target not in self.expected and not self.name_map.is_optional(target):
            self.unexpected.append(name)
            return False
        if target in self.source_of:  # e.g. an FP8 weight with both `weight_scale` and `weight_scale_inv`
            self.duplicates.append(f"{name} (and {self.source_of[target]})")
            return False
        self.source_of[target] = name
        return True

    def problems(self, excused: Callable[[_Target], bool] = lambda target: False) -> list[str]:
        """What a WeightLoadError says: expected targets no tensor filled (but the `excused`), unexpected tensors
        and duplicates; empty when the checkpoint matches."""
        missing = [hf for t, hf in self.expected.items() if t not in self.source_of and not excused(t)]
        problems = []
        if missing:
            problems.append(f"missing tensors: {_shown(missing)}")
        if self.unexpected:
            problems.append(f"unexpected tensors: {_shown(self.unexpected)}")
        if self.duplicates:
            problems.append(f"tensors loading the same parameter twice: {_shown(self.duplicates)}")
        return problems


def _optional_modules(model: nn.Module) -> list[str]:
    optional = getattr(model, "optional_checkpoint_modules", None)
    return list(optional()) if callable(optional) else []


def _load_safetensors(model: nn.Module, files: list[Path], *, progress: bool, fp8: Fp8Config | None) -> None:
    plan, absent = _plan(model, files, _NameMap(model, fp8))
    for path in sorted(absent, reverse=True):  # deepest / last first, so list indices stay valid
        logger.info("checkpoint has no %s (optional): dropped", path)
        model.drop_module(path)  # type: ignore[operator]
    params = dict(model.named_parameters())
    shapes = tensor_shapes(files) if fp8 is not None and fp8.weight_scales is not WeightScales.BLOCK else {}
    with torch.no_grad():
        for path in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=not progress):
            with safe_open(str(path), framework="pt") as f:
                for name, target in plan[path]:
                    tensor = scales_per_row(fp8, name, f.get_tensor(name), shapes)
                    _copy_into(model, params, target, name, tensor)


def _check_fp8(param: nn.Parameter, source: str, tensor: torch.Tensor) -> None:
    """An fp8 tensor only into an fp8 parameter and the reverse: a cast would silently change the weights."""
    if (param.dtype == FP8_DTYPE) != (tensor.dtype == FP8_DTYPE):
        raise WeightLoadError(
            f"{source}: checkpoint dtype {tensor.dtype} for a {param.dtype} parameter (is the module missing "
            "from, or wrongly in, quantization_config.modules_to_not_convert?)"
        )


def _copy_into(
    model: nn.Module, params: dict[str, nn.Parameter], target: _Target, source: str, tensor: torch.Tensor
) -> None:
    if target.param not in params:  # a scale held in no parameter (`_NameMap.is_optional`)
        module_path, _, name = target.param.rpartition(".")
        try:
            if target.activation_scale:
                per_tensor_scale(tensor)  # checked only: activations are quantised dynamically
            else:  # a KV cache scale: buffers of a KVScales module
                model.get_submodule(module_path).load(name, tensor)  # type: ignore[operator]
        except ValueError as error:
            raise WeightLoadError(f"{source}: {error}") from None
        return
    _check_fp8(params[target.param], source, tensor)
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
            if name.endswith(SCALE_SUFFIX):
                continue  # written with its fp8 weight
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            if param.dtype == FP8_DTYPE:
                module_path, _, attr = name.rpartition(".")
                module = model.get_submodule(module_path)
                fill_dummy(module, attr, module.fp8_block, std, gen)  # type: ignore[arg-type]
                continue
            param.data.normal_(mean=0.0, std=std, generator=gen)
