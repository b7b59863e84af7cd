"""`ParallelConfig` (the user's options, vLLM/SGLang names) and the `Topology` it implies.

Options, as vLLM and SGLang spell them:

- `tensor_parallel_size` (`-tp`): the world size; every rank is one device.
- `enable_expert_parallel` (`--enable-expert-parallel`): split routed experts by
  expert over `expert_parallel_size` ranks (default: all of them), the rest of
  the world splitting each expert's intermediate dimension (MoE TP).
- `enable_dp_attention` with `data_parallel_size` (SGLang's `--enable-dp-attention
  --dp N`): attention runs data-parallel in N groups of `tp / N` ranks, each
  group holding whole requests and their KV (MLA's one latent head cannot be
  split by heads, so TP would store every latent on every rank); the MLP/MoE
  still spans the whole world. Here `data_parallel_size` counts attention
  groups inside one engine, as in SGLang; engine replicas are separate engines
  behind the router, so `data_parallel_size > 1` without DP attention is refused.
- `all2all_backend` (vLLM's name): how MoE tokens move under DP attention:
  `allgather_reducescatter` (gather every token before the MoE, reduce-scatter
  after) or `alltoall` (dispatch each token to the ranks of its experts, combine
  back; needs expert parallelism over the whole world).

The world is a mesh of two axes, `dp` (size `attn_dp`) and `tp` (size
`attn_tp`), rank = dp_index * attn_tp + tp_index. ATTN_TP groups are
consecutive ranks; MoE TP groups too (rank = ep_index * moe_tp + moe_tp_index).
Bad combinations are refused with every problem named at once (`validate_for_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenspeed.errors import TokenSpeedError
from tokenspeed.placement.placements import ParallelGroup

if TYPE_CHECKING:
    from tokenspeed.placement.model_shape import ModelShape

ALL2ALL_BACKENDS = ("allgather_reducescatter", "alltoall")
MESH_AXES = ("dp", "tp")


class ParallelConfigError(TokenSpeedError, ValueError):
    """The parallel options do not fit each other, the model, or the machine."""

    http_status = 400


@dataclass(frozen=True, slots=True)
class Topology:
    """Group sizes and rank coordinates of one world (built by `ParallelConfig.topology`)."""

    world_size: int
    attn_tp: int
    attn_dp: int
    moe_ep: int
    moe_tp: int
    moe_all_to_all: bool = False

    @property
    def dp_attention(self) -> bool:
        return self.attn_dp > 1

    def axis_size(self, axis: str) -> int:
        return self.attn_dp if axis == "dp" else self.attn_tp

    def axes_of(self, group: ParallelGroup) -> tuple[str, ...]:
        """The mesh axes `group` spans, only those of size > 1 (a size-1 axis never needs a collective)."""
        spans = {
            ParallelGroup.ATTN_TP: ("tp",),
            ParallelGroup.ATTN_DP: ("dp",),
        }.get(group, MESH_AXES)
        return tuple(axis for axis in spans if self.axis_size(axis) > 1)

    def size(self, group: ParallelGroup) -> int:
        return {
            ParallelGroup.ATTN_TP: self.attn_tp,
            ParallelGroup.ATTN_DP: self.attn_dp,
        }.get(group, self.world_size)

    def group_ranks(self, group: ParallelGroup) -> tuple[tuple[int, ...], ...]:
        """Every group of kind `group`, as global ranks (the same on every rank, in creation order)."""
        if group is ParallelGroup.ATTN_TP:
            return tuple(
                tuple(d * self.attn_tp + t for t in range(self.attn_tp)) for d in range(self.attn_dp)
            )
        if group is ParallelGroup.ATTN_DP:
            return tuple(
                tuple(d * self.attn_tp + t for d in range(self.attn_dp)) for t in range(self.attn_tp)
            )
        return (tuple(range(self.world_size)),)

    def coordinate(self, group: ParallelGroup, rank: int) -> int:
        """`rank`'s index inside its group of kind `group`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        if group is ParallelGroup.ATTN_TP:
            return rank % self.attn_tp
        if group is ParallelGroup.ATTN_DP:
            return rank // self.attn_tp
        return rank

    def ep_index(self, rank: int) -> int:
        return rank // self.moe_tp

    def moe_tp_index(self, rank: int) -> int:
        return rank % self.moe_tp

    def describe(self) -> str:
        return (
            f"world {self.world_size}: ATTN_TP={self.attn_tp} ATTN_DP={self.attn_dp} "
            f"DENSE_TP={self.world_size} MOE_TP_EP={self.world_size} (EP={self.moe_ep} x TP={self.moe_tp}"
            f"{', all-to-all' if self.moe_all_to_all else ''})"
        )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_parallel_size: int | None = None  # None: every rank, when enable_expert_parallel
    data_parallel_size: int = 1  # attention data-parallel groups (needs enable_dp_attention)
    enable_dp_attention: bool = False
    all2all_backend: str = "allgather_reducescatter"

    def __post_init__(self) -> None:
        problems = self._option_problems()
        if problems:
            raise ParallelConfigError("invalid parallel options: " + "; ".join(problems))

    def _option_problems(self) -> list[str]:
        tp, dp, ep = self.tensor_parallel_size, self.data_parallel_size, self.expert_parallel_size
        problems = []
        for name, value in (("tensor_parallel_size", tp), ("data_parallel_size", dp), ("expert_parallel_size", ep)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        if problems:
            return problems
        if self.enable_dp_attention:
            if dp == 1:
                problems.append(
                    f"enable_dp_attention needs data_parallel_size > 1 attention groups dividing "
                    f"tensor_parallel_size={tp} (usually data_parallel_size == tensor_parallel_size)"
                )
            elif tp % dp:
                problems.append(f"data_parallel_size={dp} does not divide tensor_parallel_size={tp}")
        elif dp > 1:
            problems.append(
                f"data_parallel_size={dp} needs enable_dp_attention (attention data parallelism inside one "
                "engine); replicas of a whole engine are separate engines behind a router"
            )
        if ep is not None and not self.enable_expert_parallel:
            problems.append("expert_parallel_size is set but enable_expert_parallel is not")
        elif ep is not None and tp % ep:
            problems.append(f"expert_parallel_size={ep} does not divide tensor_parallel_size={tp}")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            problems.append(f"all2all_backend must be one of {', '.join(ALL2ALL_BACKENDS)}, got {self.all2all_backend!r}")
        elif self.all2all_backend == "alltoall" and not (
            self.enable_dp_attention and dp == tp and self.enable_expert_parallel and ep in (None, tp)
        ):
            problems.append(
                "all2all_backend='alltoall' needs enable_dp_attention with data_parallel_size == "
                "tensor_parallel_size and experts split over every rank (enable_expert_parallel): each "
                "rank then dispatches only its own tokens"
            )
        return problems

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def topology(self) -> Topology:
        world = self.tensor_parallel_size
        attn_dp = self.data_parallel_size if self.enable_dp_attention else 1
        ep = (self.expert_parallel_size or world) if self.enable_expert_parallel else 1
        return Topology(
            world_size=world,
            attn_tp=world // attn_dp,
            attn_dp=attn_dp,
            moe_ep=ep,
            moe_tp=world // ep,
            moe_all_to_all=self.all2all_backend == "alltoall",
        )

    def validate_for_model(self, config: ModelShape) -> Topology:
        """The topology, after checking every split it implies divides the model; raises naming each problem."""
        topo = self.topology()
        problems = model_problems(config, topo)
        if problems:
            raise ParallelConfigError(
                f"{config.architecture} cannot run with {self.describe()}: " + "; ".join(problems)
            )
        return topo

    def check_devices(self, available: int, platform: str) -> None:
        """Refuse more ranks than devices (one rank per device); CPU ranks are processes and always fit."""
        if platform != "cpu" and self.world_size > available:
            raise ParallelConfigError(
                f"tensor_parallel_size={self.world_size} needs {self.world_size} {platform} devices, "
                f"{available} available"
            )

    def describe(self) -> str:
        parts = [f"tensor_parallel_size={self.tensor_parallel_size}"]
        if self.enable_expert_parallel:
            parts.append(f"expert_parallel_size={self.expert_parallel_size or self.tensor_parallel_size}")
        if self.enable_dp_attention:
            parts.append(f"data_parallel_size={self.data_parallel_size} (DP attention)")
        if self.all2all_backend != "allgather_reducescatter":
            parts.append(f"all2all_backend={self.all2all_backend}")
        return ", ".join(parts)


def _divides(what: str, count: int, by: int, group: str) -> str | None:
    return None if count % by == 0 else f"{group}={by} does not divide the {count} {what}"


def model_problems(config: ModelShape, topo: Topology) -> list[str]:
    """Every reason `config` cannot be split as `topo` says ([] when it can)."""
    checks: list[str | None] = [_divides("attention heads", config.num_heads, topo.attn_tp, "ATTN_TP")]
    if config.mla is None:
        kv = config.num_kv_heads
        if topo.attn_tp <= kv:
            checks.append(_divides("kv heads", kv, topo.attn_tp, "ATTN_TP"))
        elif topo.attn_tp % kv:
            checks.append(
                f"ATTN_TP={topo.attn_tp} exceeds the {kv} kv heads but is not a multiple of them "
                "(each kv head must be replicated on a whole number of ranks)"
            )
    checks.append(_divides("vocabulary entries (vocab-parallel embedding and LM head)", config.vocab_size,
                           topo.world_size, "DENSE_TP"))
    moe = config.moe
    has_dense_mlp = moe is None or not all(moe.is_sparse(i) for i in range(config.num_layers))
    if has_dense_mlp:
        checks.append(_divides("intermediate size of the dense MLP", config.intermediate_size,
                               topo.world_size, "DENSE_TP"))
    if moe is None:
        if topo.moe_ep > 1:
            checks.append("expert parallelism needs a mixture-of-experts model")
    else:
        checks.append(_divides("routed experts", moe.num_experts, topo.moe_ep, "EP"))
        checks.append(_divides("intermediate size of each expert", moe.moe_intermediate_size, topo.moe_tp,
                               "MoE TP"))
        if moe.num_shared_experts and not topo.moe_all_to_all:
            shared = moe.num_shared_experts * moe.moe_intermediate_size
            checks.append(_divides("intermediate size of the shared experts", shared, topo.world_size,
                                   "MOE_TP_EP"))
    return [c for c in checks if c is not None]
