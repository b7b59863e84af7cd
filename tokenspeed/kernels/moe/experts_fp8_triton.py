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
Decode-sized batches without explicit `tiles` take the tiles `LaunchTuner`
timed fastest for the shape among `decode_tile_candidates` (on first eager
use; the first candidate where timing is off). Timed alone, its pick matched
the best tile of a graph stack of decode layers at 1-64 tokens on an H100
(`benchmarks/moe_decode_stack.py`, `benchmarks/results/h100/wave2/moe_decode_tiles_2026-12-06/`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from tokenspeed.kernels.autotune import LaunchTuner, TunedChoice
from tokenspeed.kernels.moe.experts_fp8_reference import check_fp8_experts_args
from tokenspeed.kernels.moe.experts_triton import (
    DECODE_TILES,
    Fp8ExpertWeights,
    TileConfig,
    align_pairs,
    launch_grouped_experts,
    sum_pairs,
    tile_config,
)
from tokenspeed.kernels.quant.fp8 import WEIGHT_BLOCK, BlockSize
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES


def decode_tile_candidates(key: tuple[Any, ...]) -> list[TileConfig]:
    """Tiles the decode-sized (w8a16) launch may take, `DECODE_TILES` first (`LaunchTuner`).

    With a token or a few, the experts hit are few and each program streams
    one slice of one expert's weights: how the slices spread over the SMs
    (gate/up and down tile widths) and how deep each program pipelines its
    loads (stages) decide the bandwidth; K steps stay one scale block.
    """
    return [
        DECODE_TILES,
        TileConfig(block_m=16, block_n_up=16, block_n_down=32, block_k=128, num_warps=4, num_stages=4),
        TileConfig(block_m=16, block_n_up=64, block_n_down=128, block_k=128, num_warps=4, num_stages=3),
        TileConfig(block_m=16, block_n_up=32, block_n_down=64, block_k=128, num_warps=4, num_stages=6),
        TileConfig(block_m=16, block_n_up=16, block_n_down=64, block_k=64, num_warps=4, num_stages=6),
    ]


_DECODE_TUNER: LaunchTuner[TileConfig] = LaunchTuner("moe.experts_fp8 decode tiles", decode_tile_candidates)


def tuned_decode_tiles() -> dict[tuple[Any, ...], TunedChoice[TileConfig]]:
    """The tiles each decode batch shape got (and the candidates' times), for benchmarks."""
    return _DECODE_TUNER.chosen()


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
    decode = tile_config(tokens, top_k, experts) == DECODE_TILES
    if quantize_activations is None:
        quantize_activations = not decode if tiles is None else tiles != DECODE_TILES
    if tiles is None and decode and not quantize_activations:
        key = (tokens, hidden_size, w2.shape[2], experts, top_k, hidden.dtype, tuple(block_size))
        run = partial(
            fused_experts_fp8_triton, hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
            w2_scale=w2_scale, block_size=block_size, quantize_activations=False,
        )  # fmt: skip
        tiles = _DECODE_TUNER.choose(key, hidden.device, lambda t: run(tiles=t))
    tiles = tiles or tile_config(tokens, top_k, experts)
    fp8 = Fp8ExpertWeights(w13_scale, w2_scale, block_size, quantize_activations)
    alignment = align_pairs(topk_ids, experts, tiles.block_m)
    weights = topk_weights.to(torch.float32).contiguous()
    pair_out = launch_grouped_experts(hidden, w13, w2, weights, alignment, top_k, tiles, fp8)
    return sum_pairs(pair_out, tokens, top_k)
