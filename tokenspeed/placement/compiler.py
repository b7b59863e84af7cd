"""The placement compiler: walk a model's modules, track placements, insert every collective.

State: the placement of the hidden state (what the last module produced) and
of the residual stream, per mesh axis (`dp`, `tp`; axes of size 1 are dropped,
so at world size 1 every state is "replicated" and no collective appears).
At each module the hidden state must become the module's input layout:

| on an axis, from -> to | op |
|---|---|
| Partial -> Replicate | all-reduce |
| Partial -> Shard(d) | reduce-scatter along d |
| Shard(d) -> Replicate | all-gather along d |
| Replicate -> Shard(d) | local slice (no communication) |

Norms are where reductions land, *deferred* as long as possible: a norm keeps
the residual stream's layout (the residual add needs both in one layout; with
no residual yet, the layout its consumer wants), so a row-parallel output
stays `Partial` through its own module and is reduced by the next norm. When
that reduction is exactly one all-reduce, it fuses with the residual add and
the RMSNorm into one op (`comm.fused_allreduce_rmsnorm`). Hence a Llama layer
at TP=2 is [fused AR+norm, attention, fused AR+norm, MLP].

Bytes per token (`PlanOp.bytes_per_token`): what each rank sends, divided by
the tokens of the whole step, with ring algorithms over n ranks and rows of B
bytes: all-reduce 2(n-1)/n·B; reduce-scatter and all-gather (n-1)/n·B; an EP
all-to-all, each rank sending its 1/n of the tokens to top_k experts of which
(n-1)/n are remote, (n-1)/n²·top_k·B. Hidden rows are `hidden_size` values of
the activation dtype; logits rows `vocab_size` fp32 values.

The plan is static (it depends only on the model config and the topology), so
every rank compiles the same plan itself; nothing about it is broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from fractions import Fraction

from tokenspeed.errors import TokenSpeedError
from tokenspeed.placement.model_graph import ModelGraph, ModuleRef
from tokenspeed.placement.module_specs import ModuleKind, ModuleSpec, module_specs
from tokenspeed.placement.parallel_config import MESH_AXES, Topology
from tokenspeed.placement.placements import Layout, ParallelGroup, Partial, Placement, Replicate, Shard

AxisState = dict[str, Placement]  # only the axes that are not replicated
LOGIT_BYTES = 4  # logits leave the LM head in fp32


class PlacementError(TokenSpeedError, ValueError):
    """Two placements cannot be joined (a spec asks for something no collective provides)."""


class OpKind(Enum):
    COMPUTE = "compute"
    FUSED_ALLREDUCE_RMSNORM = "fused_allreduce_rmsnorm"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    LOCAL_SLICE = "local_slice"

    @property
    def communicates(self) -> bool:
        return self not in (OpKind.COMPUTE, OpKind.LOCAL_SLICE)


@dataclass(frozen=True, slots=True)
class PlanOp:
    kind: OpKind
    module: ModuleRef  # the module this op runs, or whose input (LM head: output) it prepares
    group: ParallelGroup | None = None
    group_size: int = 1
    dim: int | None = None  # dimension gathered, scattered or sliced
    bytes_per_token: int = 0
    detail: str = ""  # "dispatch" / "combine" for the MoE all-to-all
    layout: Layout = ()  # the hidden state's layout after this op


@dataclass(frozen=True, slots=True)
class CompiledPlan:
    graph: ModelGraph
    topology: Topology
    dtype_bytes: int
    ops: tuple[PlanOp, ...]

    def layer_ops(self, layer: int | None) -> tuple[PlanOp, ...]:
        """The ops of decoder layer `layer`, or (None) those outside the layers."""
        return tuple(op for op in self.ops if op.module.layer == layer)

    def collectives(self) -> tuple[PlanOp, ...]:
        return tuple(op for op in self.ops if op.kind.communicates)

    def bytes_per_token(self) -> int:
        return sum(op.bytes_per_token for op in self.ops)


def _round(value: Fraction) -> int:
    return int(value + Fraction(1, 2))


class _Compiler:
    def __init__(self, graph: ModelGraph, topology: Topology, dtype_bytes: int) -> None:
        self.graph = graph
        self.topo = topology
        self.specs = module_specs(topology)
        self.row_bytes = graph.hidden_size * dtype_bytes
        self.ops: list[PlanOp] = []

    def axis_state(self, layout: Layout) -> AxisState:
        state: AxisState = {}
        for placement in layout:
            for axis in self.topo.axes_of(placement.group):
                if axis in state and state[axis] != placement:
                    raise PlacementError(f"{state[axis]} and {placement} both claim mesh axis {axis!r}")
                if not isinstance(placement, Replicate):
                    state[axis] = placement
        return state

    @staticmethod
    def layout_of(state: AxisState) -> Layout:
        return tuple(dict.fromkeys(state[axis] for axis in MESH_AXES if axis in state))

    def group_for(self, axes: tuple[str, ...], placement: Placement) -> ParallelGroup:
        """The placement's own group when it spans exactly `axes`, else the group that does."""
        if self.topo.axes_of(placement.group) == axes:
            return placement.group
        by_axes: dict[tuple[str, ...], ParallelGroup] = {
            ("tp",): ParallelGroup.ATTN_TP,
            ("dp",): ParallelGroup.ATTN_DP,
        }
        return by_axes.get(axes, ParallelGroup.DENSE_TP)

    def size_of(self, axes: tuple[str, ...]) -> int:
        size = 1
        for axis in axes:
            size *= self.topo.axis_size(axis)
        return size

    def emit(self, op: PlanOp, state: AxisState) -> None:
        """Append `op`, stamped with the hidden state's layout after it."""
        self.ops.append(replace(op, layout=self.layout_of(state)))

    def transition(self, state: AxisState, target: AxisState, module: ModuleRef) -> AxisState:
        """Emit the collectives that turn `state` into `target`; returns the new state (== target)."""
        steps: dict[tuple[OpKind, int | None], list[str]] = {}
        for axis in MESH_AXES:
            have, want = state.get(axis), target.get(axis)
            if _same(have, want):
                continue
            if isinstance(have, Partial) and want is None:
                step: tuple[OpKind, int | None] = (OpKind.ALL_REDUCE, None)
            elif isinstance(have, Partial) and isinstance(want, Shard):
                step = (OpKind.REDUCE_SCATTER, want.dim)
            elif isinstance(have, Shard) and want is None:
                step = (OpKind.ALL_GATHER, have.dim)
            elif have is None and isinstance(want, Shard):
                step = (OpKind.LOCAL_SLICE, want.dim)
            else:
                raise PlacementError(f"{module.name}: no collective turns {have} into {want} on axis {axis!r}")
            steps.setdefault(step, []).append(axis)
        order = (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.LOCAL_SLICE)
        state = dict(state)
        for (kind, dim), axes in sorted(steps.items(), key=lambda item: order.index(item[0][0])):
            n = self.size_of(tuple(axes))
            source = state[axes[0]] if axes[0] in state else target[axes[0]]
            for axis in axes:
                if axis in target:
                    state[axis] = target[axis]
                else:
                    del state[axis]
            factor = {
                OpKind.ALL_REDUCE: Fraction(2 * (n - 1), n),
                OpKind.LOCAL_SLICE: Fraction(0),
            }.get(kind, Fraction(n - 1, n))
            group = self.group_for(tuple(axes), source)
            self.emit(PlanOp(kind, module, group, n, dim, _round(factor * self.row_bytes)), state)
        return state

    def next_input(self, index: int) -> AxisState:
        """The input state the next module that is not a norm wants (norms take what they get)."""
        for ref in self.graph.modules[index + 1 :]:
            wanted = self.specs[ref.kind].input
            if wanted is not None:
                return self.axis_state(wanted)
        return {}

    def norm(self, ref: ModuleRef, spec: ModuleSpec, state: AxisState, target: AxisState) -> None:
        start = len(self.ops)
        self.transition(state, target, ref)
        added = self.ops[start:]
        if spec.absorbs_reduction and len(added) == 1 and added[0].kind is OpKind.ALL_REDUCE:
            self.ops[start] = replace(added[0], kind=OpKind.FUSED_ALLREDUCE_RMSNORM)
        else:
            self.emit(PlanOp(OpKind.COMPUTE, ref), target)

    def moe_all_to_all(self, ref: ModuleRef, state: AxisState, detail: str) -> None:
        n = self.topo.world_size
        sent = _round(Fraction((n - 1) * self.graph.top_k, n * n) * self.row_bytes)
        self.emit(PlanOp(OpKind.ALL_TO_ALL, ref, ParallelGroup.MOE_TP_EP, n, None, sent, detail), state)

    def run(self) -> tuple[PlanOp, ...]:
        modules = self.graph.modules
        if not modules or modules[0].kind is not ModuleKind.EMBEDDING:
            raise PlacementError("a model graph starts with its embedding")
        first_input = self.specs[ModuleKind.EMBEDDING].input
        assert first_input is not None
        state = self.axis_state(first_input)  # the executor hands each rank its tokens this way
        residual: AxisState | None = None
        for index, ref in enumerate(modules):
            spec = self.specs[ref.kind]
            if spec.input is None:
                target = residual if residual is not None else self.next_input(index)
                self.norm(ref, spec, state, target)
                state = residual = dict(target)
                continue
            state = self.transition(state, self.axis_state(spec.input), ref)
            if spec.all_to_all:
                self.moe_all_to_all(ref, state, "dispatch")
            state = state if spec.output is None else self.axis_state(spec.output)
            self.emit(PlanOp(OpKind.COMPUTE, ref), state)
            if spec.all_to_all:
                self.moe_all_to_all(ref, state, "combine")
            if ref.kind is ModuleKind.LM_HEAD:
                self.row_bytes = self.graph.vocab_size * LOGIT_BYTES
        self.transition(state, {}, modules[-1])  # rank 0 samples from whole logits
        return tuple(self.ops)


def _same(have: Placement | None, want: Placement | None) -> bool:
    if isinstance(have, Partial) and isinstance(want, Partial):
        return True
    if isinstance(have, Shard) and isinstance(want, Shard):
        return have.dim == want.dim
    return have is None and want is None


def compile_plan(graph: ModelGraph, topology: Topology, *, dtype_bytes: int) -> CompiledPlan:
    """The op list of `graph` on `topology` (see the module docstring)."""
    return CompiledPlan(graph, topology, dtype_bytes, _Compiler(graph, topology, dtype_bytes).run())
