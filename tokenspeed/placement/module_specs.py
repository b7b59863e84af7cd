"""`ModuleSpec`: the placement contract of each module kind, for one topology.

A module author states only what the module's math needs: attention and MLPs
want every token of their rank's batch replicated over their group and leave
a row-parallel GEMM's pending sum (`Partial`); a norm is token-local, keeps
whatever token layout it is given, and may *absorb* a pending reduction (the
all-reduce, the residual add and the RMSNorm become one kernel). The compiler
(`compiler.py`) then chooses every collective; no module ever calls one by
itself, except the all-to-all pair inside an expert-parallel MoE, which the
spec declares (`all_to_all`) so it still shows in the plan.

The layouts per topology (tp = ATTN_TP ranks, dp = ATTN_DP groups):

| kind | input | output | weights |
|---|---|---|---|
| embedding | tokens | Partial(DENSE_TP); with DP attention: tokens | vocab-parallel; replicated under DP attention |
| norm | as given, reduced | as input | replicated |
| attention, MLA attention | tokens | tokens + Partial(ATTN_TP) | heads split over ATTN_TP |
| dense MLP | Replicate | Partial(DENSE_TP) | intermediate split over the world |
| MoE | Replicate | Partial(MOE_TP_EP) | experts by EP x intermediate by MoE TP |
| MoE, all-to-all | tokens | tokens (dispatch/combine inside) | experts by EP |
| LM head | Replicate | Shard(-1, DENSE_TP) (vocab) | vocab-parallel |

where "tokens" is `Replicate` without DP attention and `Shard(0, ATTN_DP)`
with it (each attention group holds its own requests' tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tokenspeed.placement.parallel_config import Topology
from tokenspeed.placement.placements import REPLICATED, Layout, ParallelGroup, Partial, Shard


class ModuleKind(Enum):
    EMBEDDING = "embedding"
    NORM = "norm"
    ATTENTION = "attention"
    MLA_ATTENTION = "mla_attention"
    DENSE_MLP = "dense_mlp"
    MOE = "moe"
    LM_HEAD = "lm_head"


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    kind: ModuleKind
    input: Layout | None  # None: any layout whose values are complete (a pending Partial is reduced first)
    output: Layout | None  # None: the layout of its input
    absorbs_reduction: bool = False  # a pending all-reduce fuses into it (all-reduce + residual add + RMSNorm)
    all_to_all: bool = False  # dispatches tokens to their experts' ranks and combines them back (EP)


def module_specs(topology: Topology) -> dict[ModuleKind, ModuleSpec]:
    """The spec of every module kind under `topology` (see the module docstring's table)."""
    tokens: Layout = (Shard(0, ParallelGroup.ATTN_DP),) if topology.dp_attention else REPLICATED
    attention_output = tokens + (Partial(ParallelGroup.ATTN_TP),)
    # under DP attention each rank embeds its own tokens with a whole table; else the vocab is split
    embedding_output = tokens if topology.dp_attention else (Partial(ParallelGroup.DENSE_TP),)
    if topology.moe_all_to_all:
        moe = ModuleSpec(ModuleKind.MOE, tokens, tokens, all_to_all=True)
    else:
        moe = ModuleSpec(ModuleKind.MOE, REPLICATED, (Partial(ParallelGroup.MOE_TP_EP),))
    specs = [
        ModuleSpec(ModuleKind.EMBEDDING, tokens, embedding_output),
        ModuleSpec(ModuleKind.NORM, None, None, absorbs_reduction=True),
        ModuleSpec(ModuleKind.ATTENTION, tokens, attention_output),
        ModuleSpec(ModuleKind.MLA_ATTENTION, tokens, attention_output),
        ModuleSpec(ModuleKind.DENSE_MLP, REPLICATED, (Partial(ParallelGroup.DENSE_TP),)),
        moe,
        ModuleSpec(ModuleKind.LM_HEAD, REPLICATED, (Shard(-1, ParallelGroup.DENSE_TP),)),
    ]
    return {spec.kind: spec for spec in specs}
