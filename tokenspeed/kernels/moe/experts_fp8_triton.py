"""Triton fused MoE with FP8 expert weights (`moe.experts_fp8`, name "triton"): the kernels of `experts_triton`.

Same two grouped GEMMs, alignment and k-sum as `experts_triton.fused_experts_triton`
(the kernels take fp8 weights and their block scales through `W_FP8`); what
changes is the operand precision, by batch (`tile_config`):
- decode-sized batches (`DECODE_TILES`, <= 16 pairs per expert) stream
  weights: activations stay in their dtype, each fp8 weight tile is widened
  in registers and its fp32 product scaled per K tile, so the bytes read
  halve and no activation is quantised (no extra launches at decode);
- larger batches quantise the hidden rows and the intermediate activations
  per token and group of 128 (`quant.per_token_group`, one launch each) and
  run fp8 x fp8 on tensor cores, scales applied per K tile.
`quantize_activations` forces either (tests and benchmarks). The reference
(`experts_fp8_reference`) reproduces both, so the tests compare tightly.
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.moe.experts_fp8_reference import check_fp8_experts_args
from tokenspeed.kernels.moe.experts_triton import (
    DECODE_TILES,
    Fp8ExpertWeights,
    TileConfig,
    align_pairs,
    launch_grouped_experts,
    tile_config,
)
from tokenspeed.kernels.quant.fp8 import WEIGHT_BLOCK, BlockSize
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES


@register_kernel(
    "moe", "experts_fp8", name="triton", band=Band.PERFORMANT, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def fused_experts_fp8_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    block_size: BlockSize = WEIGHT_BLOCK,
    tiles: TileConfig | None = None,
    quantize_activations: bool | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * Expert_{topk_ids[:, k]}(hidden) with fp8 experts; see the module docstring."""
    tokens, hidden_size, _, experts = check_fp8_experts_args(
        hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_size
    )
    top_k = topk_ids.shape[1]
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    tiles = tiles or tile_config(tokens, top_k, experts)
    if quantize_activations is None:
        quantize_activations = tiles != DECODE_TILES
    fp8 = Fp8ExpertWeights(w13_scale, w2_scale, block_size, quantize_activations)
    alignment = align_pairs(topk_ids, experts, tiles.block_m)
    weights = topk_weights.to(torch.float32).contiguous()
    pair_out = launch_grouped_experts(hidden, w13, w2, weights, alignment, top_k, tiles, fp8)
    return pair_out.view(tokens, top_k, hidden_size).sum(dim=1)
