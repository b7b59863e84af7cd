"""Routed experts through torch's grouped GEMM (`F.grouped_mm`, CUTLASS on Hopper).

Signature: as `experts_reference.fused_experts_reference` (registered as
`moe.experts`, name "grouped_mm", cuda, bf16, for batches of at least
`GROUPED_MM_MIN_TOKENS` tokens).

The pairs are sorted by expert (`align.sort_by_expert`), their token rows
gathered into one [T*k, H] matrix, and each GEMM is one grouped-GEMM call
over the per-expert row ranges (`offs` = inclusive cumulative counts, int32,
on the device, so nothing syncs and the op is CUDA-graph safe). The weights
are passed as transposed views ([E, H, 2I] and [E, I, H], K-major), which is
the layout the CUTLASS kernel wants, so no weight is copied. The routed rows
are scaled by their fp32 weights, put back in (token, k) order and summed
over k (fp32 accumulation inside `sum`).

The Triton kernel (`experts_triton`) fuses the activation into the first GEMM
and needs no gather/scatter passes; it was expected to lose to CUTLASS once the
op is compute bound, but on the H200 it measured faster at every size from 16
to 16384 tokens (1.4-2.0x, `benchmarks/results/h200_moe_kernels.json`), so this
kernel is PORTABLE, below it, eligible only from `GROUPED_MM_MIN_TOKENS` and
used by override (`--kernel moe.experts=grouped_mm`) or where Triton is
missing. The op is `torch.nn.functional.grouped_mm` (public
since torch 2.10), else the private `torch._grouped_mm` it wraps; where
neither exists this kernel is not registered and selection keeps Triton.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenspeed.kernels.moe.align import sort_by_expert
from tokenspeed.kernels.moe.experts_reference import check_experts_args
from tokenspeed.kernels.registry import Band, register_kernel

# Smallest batch (tokens) for which `grouped_mm` is eligible: below it an expert sees
# fewer than ~50 rows and a grouped GEMM's per-group tiles are mostly padding.
GROUPED_MM_MIN_TOKENS = 512
MAX_TOKENS = 2**31 - 1

_grouped_mm: Callable[..., torch.Tensor] | None = getattr(F, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)
GROUPED_MM_AVAILABLE = _grouped_mm is not None


def fused_experts_grouped_mm(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * Expert_{topk_ids[:, k]}(hidden), through two grouped GEMMs."""
    if _grouped_mm is None:
        raise RuntimeError("this torch has neither torch.nn.functional.grouped_mm nor torch._grouped_mm")
    tokens, hidden_size, inter, experts = check_experts_args(hidden, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    grouped = sort_by_expert(topk_ids, experts)
    offs = grouped.ends.to(torch.int32)
    rows = hidden.index_select(0, grouped.order // top_k)
    gate_up = _grouped_mm(rows, w13.transpose(1, 2), offs=offs)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    routed = _grouped_mm(act, w2.transpose(1, 2), offs=offs)
    scaled = (routed.float() * topk_weights.reshape(-1).float()[grouped.order, None]).to(hidden.dtype)
    pair_out = torch.empty_like(scaled).index_copy_(0, grouped.order, scaled)
    return pair_out.view(tokens, top_k, hidden_size).sum(dim=1)


if GROUPED_MM_AVAILABLE:
    register_kernel(
        "moe",
        "experts",
        name="grouped_mm",
        band=Band.PORTABLE,
        platforms=("cuda",),
        dtypes=(torch.bfloat16,),
        workload={"num_tokens": (GROUPED_MM_MIN_TOKENS, MAX_TOKENS)},
        impl=fused_experts_grouped_mm,
    )
