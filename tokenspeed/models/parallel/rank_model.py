"""Build and load one rank's model: local sizes, only this rank's slices of the checkpoint, the compiled plan.

`build_rank_model` is what a rank of a multi-rank executor calls instead of
`executor.load_model`: the family builds from its local config
(`local_config.py`) under the rank's context (vocab-parallel embedding and
head, this EP rank's experts), the weights come through
`ShardedCheckpointReader` (a rank never reads, let alone materialises, a
tensor it does not hold), and the model is wrapped in `PlannedModel`, which
runs the compiler's op list. Names are checked as the single-device loader
checks them: every parameter filled, no tensor left without a home.

A row-parallel bias (`o_proj`, `down_proj`) is read whole by every rank of
its group and kept on the group's first rank only, so the sum of the partial
outputs carries it once.

FP8 weights (`fp8`) go in as on one device (`models/fp8_model.py`): an FP8
checkpoint's slices and their scales into fp8 storage (block scales of the
blocks a slice falls in, per-row scales of its rows), or
the loaded slices quantised online with the whole rows' amax
(`fp8_sharding.py`), so each rank holds exactly its share of what one
device would hold.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tokenspeed.layers.fp8_weights import fp8_weight_allocation
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.fp8_model import finish_fp8, prepare_fp8
from tokenspeed.models.loader import TensorMatch, WeightLoadError, _copy_into, _NameMap, load_dummy_weights
from tokenspeed.models.parallel.fp8_sharding import amax_reducer
from tokenspeed.models.parallel.local_config import local_model_config
from tokenspeed.models.parallel.planned_model import PlannedModel
from tokenspeed.models.parallel.sharded_reader import ReadStats, ShardedCheckpointReader
from tokenspeed.models.quant_config import Fp8Config
from tokenspeed.models.registry import build_model
from tokenspeed.placement.compiler import compile_plan
from tokenspeed.placement.model_graph import describe_model
from tokenspeed.placement.placements import ParallelGroup
from tokenspeed.placement.process_groups import ParallelGroups
from tokenspeed.placement.rank_context import RankContext, building_for_rank

_ROW_PARALLEL = {"o_proj": ParallelGroup.ATTN_TP, "down_proj": ParallelGroup.DENSE_TP}


def build_rank_model(
    config: ModelConfig,
    folder: Path | None,
    groups: ParallelGroups,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    fp8: Fp8Config | None = None,
) -> tuple[PlannedModel, ReadStats | None]:
    """This rank's model, loaded (`folder` None: seeded dummy weights), and what it read."""
    topology = groups.topology
    with building_for_rank(RankContext(groups)), fp8_weight_allocation(fp8 is not None and fp8.serialized):
        model = build_model(local_model_config(config, topology), dtype=dtype, device=device)
    prepare_fp8(model, fp8)
    stats = None
    if folder is None:
        load_dummy_weights(model, seed=seed)
    else:
        stats = load_rank_weights(model, folder, config, groups, fp8=fp8)
    finish_fp8(model, fp8, lambda weight: amax_reducer(weight, config, groups))
    _keep_row_biases_once(model, groups)
    model.eval()
    plan = compile_plan(describe_model(config), topology, dtype_bytes=torch.finfo(dtype).bits // 8)
    return PlannedModel(model, plan, groups), stats


def load_rank_weights(
    model: nn.Module,
    folder: Path,
    config: ModelConfig,
    groups: ParallelGroups,
    *,
    fp8: Fp8Config | None = None,
) -> ReadStats:
    reader = ShardedCheckpointReader(folder, config, groups.topology, groups.rank, fp8=fp8)
    match = TensorMatch(_NameMap(model, fp8))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor, _part in reader:
            if _is_mtp_layer(name, config):
                continue  # not built on N ranks (`local_config.py`)
            target = match.name_map.resolve(name)
            # tensor None: scales whose weight is missing, which `problems` reports
            if target is not None and match.accept(name, target) and tensor is not None:
                _copy_into(model, params, target, name, tensor)
    problems = match.problems()
    if problems:
        raise WeightLoadError(
            f"checkpoint {folder} does not match {config.architecture} on rank {groups.rank}: " + "; ".join(problems)
        )
    return reader.stats


def _is_mtp_layer(name: str, config: ModelConfig) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= config.num_layers


def _keep_row_biases_once(model: nn.Module, groups: ParallelGroups) -> None:
    for name, module in model.named_modules():
        group = _ROW_PARALLEL.get(name.rpartition(".")[2])
        bias = getattr(module, "bias", None)
        if group is None or not isinstance(bias, torch.Tensor):
            continue
        handle = groups[group]
        if handle.size > 1 and handle.rank != 0:
            with torch.no_grad():
                bias.zero_()
