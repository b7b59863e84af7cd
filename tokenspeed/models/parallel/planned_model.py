"""`PlannedModel`: one rank's forward pass, executed op by op from the compiled placement plan.

The model family's own `forward` is the single-device program (and keeps its
fused decode forms there). On N ranks the same modules run, but in the order
and with the collectives that `placement.compiler` decided: this class turns
each `PlanOp` into a step once, at build time (module looked up by its name,
group handle and fused kernel resolved), so a forward pass is a flat loop
over prepared steps that CUDA graphs can capture like any other code.

Nothing here knows a family: a step is chosen by the op's kind and, for a
compute op, by its module's kind (embedding, norm, GQA or MLA attention,
MLP or MoE, LM head). The ops of the LM head (and the final gather of the
vocabulary slices, so every rank, rank 0 included, samples from whole
logits) run in `compute_logits`; everything before them in `forward`.

Token-sharded layouts (DP attention, `Shard(0, ATTN_DP)`): each rank holds
its own requests' rows, and the counts differ from rank to rank, but gloo and
NCCL gather and scatter equal shards. So the runner states, before each step,
how many rows this rank holds and how many every rank pads to (`dp_rows`:
one `TokenRows` for the body's tokens, one for the LM head's logits rows); a
dim-0 all-gather pads this rank's rows with zeros to that count first, and a
dim-0 reduce-scatter keeps only this rank's real rows of its padded shard.
The gathered tensor is rank-major (rank r's rows at `[r * padded, ...)`): the
runner puts the logits back in the plan's row order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenspeed.kernels.registry import Band
from tokenspeed.placement.collectives import (
    all_gather,
    all_reduce,
    partial_sums,
    reduce_scatter,
    select_fused_allreduce_rmsnorm,
)
from tokenspeed.placement.compiler import CompiledPlan, OpKind, PlanOp
from tokenspeed.placement.module_specs import ModuleKind
from tokenspeed.placement.process_groups import GroupHandle, ParallelGroups

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import ForwardBatch
    from tokenspeed.batch.kv_storage import PagedKVStorage

# (hidden, residual, batch, kv) -> (hidden, residual)
State = tuple[torch.Tensor, torch.Tensor | None]
Step = Callable[[torch.Tensor, "torch.Tensor | None", Any, Any], State]


class PlanExecutionError(RuntimeError):
    """The compiled plan names something this model cannot run."""


@dataclass(frozen=True, slots=True)
class TokenRows:
    """Rows of a token-sharded tensor on this rank (`local`), and the equal shard every rank pads to."""

    local: int
    padded: int


@dataclass(frozen=True, slots=True)
class DPRows:
    """One step's row counts under DP attention: the decoder's tokens, and the rows the LM head scores."""

    tokens: TokenRows
    logits: TokenRows


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    if x.shape[0] > rows:
        raise PlanExecutionError(f"{x.shape[0]} rows on this rank, but the step pads shards to {rows}")
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


class PlannedModel(nn.Module):
    def __init__(self, model: nn.Module, plan: CompiledPlan, groups: ParallelGroups) -> None:
        super().__init__()
        self.inner = model
        self.config = getattr(model, "config", None)
        self.plan = plan
        self.groups = groups
        param = next(model.parameters())
        fused = select_fused_allreduce_rmsnorm(param.device, param.dtype)
        # Only the reference fits a process group (all-reduce, then the norm): then the norm's own
        # registry kernel does the norm, which on a GPU is the fast one rather than torch ops.
        self._fused = None if fused.band == Band.REFERENCE else fused.impl
        self.dp_rows: DPRows | None = None  # set by the runner before each step under DP attention
        self._body: list[Step] = []
        self._head: list[Step] = []
        for op in plan.ops:
            (self._head if op.module.kind is ModuleKind.LM_HEAD else self._body).append(self._step(op))

    # ---- the forward pass ---------------------------------------------------------------

    def forward(self, batch: ForwardBatch, kv: PagedKVStorage) -> torch.Tensor:
        hidden: torch.Tensor = batch.input_ids
        residual: torch.Tensor | None = None
        for step in self._body:
            hidden, residual = step(hidden, residual, batch, kv)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        residual: torch.Tensor | None = None
        for step in self._head:
            hidden, residual = step(hidden, residual, None, None)
        return hidden

    # ---- one op -> one step ---------------------------------------------------------------

    def _group(self, op: PlanOp) -> GroupHandle:
        if op.group is None:
            raise PlanExecutionError(f"{op.kind.value} at {op.module.name} names no group")
        return self.groups[op.group]

    def _step(self, op: PlanOp) -> Step:
        kind = op.kind
        if kind is OpKind.COMPUTE:
            return self._compute(op)
        if kind is OpKind.FUSED_ALLREDUCE_RMSNORM:
            return self._fused_norm(op)
        group = self._group(op)
        dim = 0 if op.dim is None else op.dim
        if kind is OpKind.ALL_REDUCE:
            return lambda h, r, b, kv: (all_reduce(h, group), r)
        if kind in (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER) and dim == 0:
            return self._token_step(op, group)
        if kind is OpKind.ALL_GATHER:
            return lambda h, r, b, kv: (all_gather(h, group, dim=dim), r)
        if kind is OpKind.REDUCE_SCATTER:
            return lambda h, r, b, kv: (reduce_scatter(h, group, dim=dim), r)
        raise PlanExecutionError(
            f"{kind.value} at {op.module.name}: token-sharded layouts (DP attention, all-to-all MoE) "
            "are not executed yet"
        )

    def _token_step(self, op: PlanOp, group: GroupHandle) -> Step:
        """A dim-0 (token) gather or scatter: equal shards, padded to this step's `dp_rows`."""
        head = op.module.kind is ModuleKind.LM_HEAD
        gather = op.kind is OpKind.ALL_GATHER

        def step(h: torch.Tensor, r: torch.Tensor | None, b: Any, kv: Any) -> State:
            if self.dp_rows is None:
                raise PlanExecutionError(f"{op.kind.value} of tokens at {op.module.name}: the step set no dp_rows")
            rows = self.dp_rows.logits if head else self.dp_rows.tokens
            if gather:
                return all_gather(_pad_rows(h, rows.padded), group, dim=0), r
            return reduce_scatter(h, group, dim=0)[: rows.local], r

        return step

    def _fused_norm(self, op: PlanOp) -> Step:
        norm = self.inner.get_submodule(op.module.name)
        group = self._group(op)
        fused = self._fused
        if fused is None:
            unfused = self._compute(replace(op, kind=OpKind.COMPUTE))
            return lambda h, r, b, kv: unfused(all_reduce(h, group), r, b, kv)

        def step(h: torch.Tensor, r: torch.Tensor | None, b: Any, kv: Any) -> State:
            out, residual = fused(partial_sums(h, group), norm.weight, norm.eps, r)
            return out, residual

        return step

    def _compute(self, op: PlanOp) -> Step:
        module = self.inner.get_submodule(op.module.name)
        kind = op.module.kind
        layer = op.module.layer
        if kind in (ModuleKind.EMBEDDING, ModuleKind.DENSE_MLP, ModuleKind.MOE, ModuleKind.LM_HEAD):
            if kind is ModuleKind.LM_HEAD:
                module = self.inner  # the family's compute_logits: its decode GEMV on this rank's vocab rows
                return lambda h, r, b, kv: (module.compute_logits(h), r)
            return lambda h, r, b, kv: (module(h), r)
        if kind is ModuleKind.NORM:

            def norm(h: torch.Tensor, r: torch.Tensor | None, b: Any, kv: Any) -> State:
                if r is None:
                    return module(h), h
                out, residual = module(h, r)
                return out, residual

            return norm
        if kind is ModuleKind.ATTENTION:
            return lambda h, r, b, kv: (module(b.positions, h, b.attn, *kv.layer(layer)), r)
        if kind is ModuleKind.MLA_ATTENTION:
            return lambda h, r, b, kv: (module(b.positions, h, b.attn, kv.layer(layer)[0]), r)
        raise PlanExecutionError(f"no step for a {kind.value} module ({op.module.name})")
