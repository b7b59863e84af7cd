"""Which part of each checkpoint tensor a rank holds: one rule per weight kind.

| weight | kind | split over |
|---|---|---|
| `embed_tokens`, `lm_head`, MTP `shared_head.head` | vocab rows | DENSE_TP (embedding replicated under DP attention) |
| `q_proj`, MLA `q_b_proj` / `kv_b_proj` | column (rows = heads) | ATTN_TP |
| `k_proj`, `v_proj` | kv heads; a head replicated on tp/kv ranks when tp > kv heads | ATTN_TP |
| `o_proj` | row (input columns = heads) | ATTN_TP |
| MLA `q_a_proj`, `kv_a_proj_with_mqa` | replicated: the latent is shared by all heads | - |
| `gate_proj`, `up_proj` (dense MLP) | column (each half of the merged gate_up on its own) | DENSE_TP |
| `down_proj` (dense MLP) | row | DENSE_TP |
| `experts.{e}.*` | on the EP rank owning expert e only; gate/up column, down row | EP x MoE TP |
| `shared_experts.*` | column / row (replicated under all-to-all MoE) | MOE_TP_EP |
| norms, router `gate`, `e_score_correction_bias`, MTP `eh_proj` | replicated | - |
| per-tensor KV cache scales `self_attn.{k,v,kv}_scale` | replicated | - |
| static activation scales `*.input_scale` (per tensor, checked, unused) | replicated | - |
| block-FP8 `*.weight_scale_inv` | the blocks its weight's slice falls in (`fp8_sharding.py`) | as its weight |
| per-tensor / per-channel FP8 `*.weight_scale` | made per row, then the rows its weight's slice holds | as its weight |

Biases follow their weight's output split; a row-parallel bias is replicated
and added on one rank only, before the reduction. With attention TP of 1
(every DP-attention rank its own group) the attention weights are whole on
every rank, which is the MLA data-parallel layout.

A rule gives a `TensorSlice`: one contiguous range along one dimension, which
`safe_open(...).get_slice(name)[...]` reads without materialising the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from tokenspeed.placement.parallel_config import ParallelConfigError, Topology
from tokenspeed.placement.placements import ParallelGroup

if TYPE_CHECKING:
    from tokenspeed.models.config import ModelConfig



class WeightKind(Enum):
    REPLICATED = "replicated"
    COLUMN = "column"  # output rows split evenly
    ROW = "row"  # input columns split evenly
    KV_HEADS = "kv_heads"  # rows split by kv head, heads replicated when the group outnumbers them
    VOCAB = "vocab"  # vocabulary rows split evenly
    EXPERT_COLUMN = "expert_column"  # one expert's gate/up: on its EP rank only, rows split over MoE TP
    EXPERT_ROW = "expert_row"  # one expert's down: on its EP rank only, columns split over MoE TP


@dataclass(frozen=True, slots=True)
class ShardRule:
    kind: WeightKind
    group: ParallelGroup | None = None
    expert: int | None = None  # EXPERT_* kinds: which expert, of how many
    num_experts: int = 0
    head_dim: int = 0  # KV_HEADS

    @property
    def sharded(self) -> bool:
        return self.kind is not WeightKind.REPLICATED


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Rows [start, stop) along `dim`; `dim` None: the whole tensor."""

    dim: int | None = None
    start: int = 0
    stop: int = 0

    def index(self, ndim: int) -> tuple[slice, ...]:
        if self.dim is None:
            return (slice(None),) * ndim
        return tuple(slice(self.start, self.stop) if d == self.dim else slice(None) for d in range(ndim))

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return full
        return tuple(self.stop - self.start if d == self.dim else n for d, n in enumerate(full))

    def numel(self, full: tuple[int, ...]) -> int:
        count = 1
        for n in self.shape(full):
            count *= n
        return count


WHOLE = TensorSlice()
_EXPERT_PROJECTIONS = {  # Qwen3-MoE / DeepSeek names, then Mixtral's
    "gate_proj": WeightKind.EXPERT_COLUMN,
    "up_proj": WeightKind.EXPERT_COLUMN,
    "down_proj": WeightKind.EXPERT_ROW,
    "w1": WeightKind.EXPERT_COLUMN,
    "w3": WeightKind.EXPERT_COLUMN,
    "w2": WeightKind.EXPERT_ROW,
}


class WeightShardingError(ParallelConfigError):
    """A checkpoint tensor has no sharding rule, or does not split as its rule says."""


def rule_for(name: str, config: ModelConfig, topology: Topology) -> ShardRule:
    """The sharding rule of checkpoint tensor `name` (HF spelling) of a `config` model on `topology`.

    A split over a group of one rank is no split: such a tensor is REPLICATED.
    """
    rule = _rule(name, config, topology)
    if rule.group is not None and topology.size(rule.group) == 1:
        return ShardRule(WeightKind.REPLICATED)
    return rule


def _rule(name: str, config: ModelConfig, topology: Topology) -> ShardRule:
    parts = name.split(".")
    param, module = parts[-1], parts[-2] if len(parts) > 1 else ""
    replicated = ShardRule(WeightKind.REPLICATED)
    if module.endswith("norm") or module in ("gate", "eh_proj") or param == "e_score_correction_bias":
        return replicated
    if param == "input_scale":  # a static activation scale, per tensor: checked, unused (models/quant_config.py)
        return replicated
    if module == "embed_tokens":
        return replicated if topology.dp_attention else ShardRule(WeightKind.VOCAB, ParallelGroup.DENSE_TP)
    if module == "lm_head" or parts[-3:-1] == ["shared_head", "head"]:
        return ShardRule(WeightKind.VOCAB, ParallelGroup.DENSE_TP)
    if "experts" in parts:
        at = parts.index("experts")
        if len(parts) == at + 4 and parts[at + 1].isdigit() and config.moe is not None:
            kind = _EXPERT_PROJECTIONS.get(parts[at + 2])
            if kind is not None:
                expert = int(parts[at + 1])
                return ShardRule(kind, ParallelGroup.MOE_TP_EP, expert=expert, num_experts=config.moe.num_experts)
        raise WeightShardingError(
            f"no sharding rule for {name!r}: experts are read as per-expert tensors "
            "(experts.{e}.gate_proj.weight, ...), as checkpoints store them"
        )
    if module in ("gate_proj", "up_proj", "down_proj"):
        if "shared_experts" in parts:
            if topology.moe_all_to_all:
                return replicated  # each rank runs them on its own tokens
            group = ParallelGroup.MOE_TP_EP
        else:
            group = ParallelGroup.DENSE_TP
        return _column_or_row(module != "down_proj", param, group)
    if "self_attn" in parts:
        group = ParallelGroup.ATTN_TP
        if module == "self_attn" and param in ("k_scale", "v_scale", "kv_scale"):  # layers/kv_scales.py
            return ShardRule(WeightKind.KV_HEADS, group, head_dim=1)  # per head, or one for all (whole)
        if module in ("q_a_proj", "kv_a_proj_with_mqa"):
            return replicated
        if module in ("q_proj", "q_b_proj", "kv_b_proj"):
            return ShardRule(WeightKind.COLUMN, group)
        if module in ("k_proj", "v_proj"):
            return ShardRule(WeightKind.KV_HEADS, group, head_dim=config.head_dim)
        if module == "o_proj":
            return _column_or_row(False, param, group)
    raise WeightShardingError(f"no sharding rule for checkpoint tensor {name!r}")


def _column_or_row(column: bool, param: str, group: ParallelGroup) -> ShardRule:
    if column:
        return ShardRule(WeightKind.COLUMN, group)
    # a row-parallel bias is whole on every rank and added once, before the reduction
    return ShardRule(WeightKind.ROW, group) if param == "weight" else ShardRule(WeightKind.REPLICATED)


def _even(name: str, shape: tuple[int, ...], dim: int, parts: int, index: int) -> TensorSlice:
    if dim >= len(shape):
        raise WeightShardingError(f"{name}: cannot split dimension {dim} of a tensor of shape {shape}")
    if shape[dim] % parts:
        raise WeightShardingError(f"{name}: dimension {dim} of shape {shape} does not split into {parts}")
    size = shape[dim] // parts
    return TensorSlice(dim, index * size, (index + 1) * size)


def rank_holds(name: str, rule: ShardRule, topology: Topology, rank: int) -> bool:
    """Whether `rank` holds any of tensor `name`: all but other EP ranks' experts (their shapes need not be known)."""
    if rule.kind not in (WeightKind.EXPERT_COLUMN, WeightKind.EXPERT_ROW):
        return True
    assert rule.expert is not None
    per_rank = rule.num_experts // topology.moe_ep  # EP rank i holds experts [i * per_rank, (i+1) * per_rank)
    if rule.num_experts % topology.moe_ep or not 0 <= rule.expert < rule.num_experts:
        raise WeightShardingError(f"{name}: expert {rule.expert} of {rule.num_experts} over EP={topology.moe_ep}")
    return rule.expert // per_rank == topology.ep_index(rank)


def slice_for_rank(
    name: str, rule: ShardRule, shape: tuple[int, ...], topology: Topology, rank: int
) -> TensorSlice | None:
    """The part of tensor `name` (of `shape`) that `rank` holds; None when it holds none of it."""
    kind = rule.kind
    if kind is WeightKind.REPLICATED:
        return WHOLE
    if not rank_holds(name, rule, topology, rank):
        return None
    if kind in (WeightKind.EXPERT_COLUMN, WeightKind.EXPERT_ROW):
        dim = 0 if kind is WeightKind.EXPERT_COLUMN else 1
        if topology.moe_tp == 1:
            return WHOLE
        return _even(name, shape, dim, topology.moe_tp, topology.moe_tp_index(rank))
    assert rule.group is not None
    parts, index = topology.size(rule.group), topology.coordinate(rule.group, rank)
    if parts == 1:
        return WHOLE
    if kind is WeightKind.ROW:
        return _even(name, shape, 1, parts, index)
    if kind is WeightKind.KV_HEADS:
        if not shape or shape[0] == rule.head_dim:  # one head's worth (a per-tensor KV scale): every rank's
            return WHOLE
        heads = shape[0] // rule.head_dim
        if parts > heads:  # this rank's kv head, shared with parts // heads ranks
            head = index * heads // parts
            return TensorSlice(0, head * rule.head_dim, (head + 1) * rule.head_dim)
    return _even(name, shape, 0, parts, index)


