"""Reference routed experts with FP8 weights (`moe.experts_fp8`): dequantise each used expert, then the bf16 loop.

Signature (the contract of every `moe.experts_fp8` kernel)::

    fused_experts_fp8(hidden [T, H], w13 fp8 [E, 2I, H], w2 fp8 [E, H, I], topk_weights fp32 [T, k],
                      topk_ids int32 [T, k], *, w13_scale fp32 [E, ceil(2I/bn), ceil(H/bk)],
                      w2_scale fp32 [E, ceil(H/bn), ceil(I/bk)], block_size=(bn, bk)) -> [T, H]

Expert e's weights are w_fp8[e] * scale[e, n // bn, k // bk], the layout of
DeepSeek-V3's and Qwen3-*-FP8's expert `weight_scale_inv` stacked over
experts (gate rows then up rows in w13, as `moe.experts`). The experts run
exactly as `experts_reference.fused_experts_reference` on the dequantised
weights (only the experts the batch uses are dequantised, in hidden's dtype).
`quantize_activations=True` also quantises each GEMM's input per token and
group of 128, which is what the Triton kernel does for larger batches (tests).
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.moe.experts_reference import check_experts_args, routed_experts_loop
from tokenspeed.kernels.quant.fp8 import (
    FP8_DTYPE,
    GROUP_SIZE,
    WEIGHT_BLOCK,
    BlockSize,
    dequantize_per_token_group,
    dequantize_weight,
    quantize_per_token_group,
)
from tokenspeed.kernels.registry import Band, register_kernel


def check_fp8_experts_args(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    block_size: BlockSize,
) -> tuple[int, int, int, int]:
    """(tokens, hidden size, intermediate size, experts), after `check_experts_args` and the fp8 checks."""
    tokens, hidden_size, inter, experts = check_experts_args(hidden, w13, w2, topk_weights, topk_ids)
    bn, bk = block_size
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"expert weights must be {FP8_DTYPE}, got {w13.dtype} and {w2.dtype}")
    for name, scale, (rows, cols) in (
        ("w13", w13_scale, (2 * inter, hidden_size)),
        ("w2", w2_scale, (hidden_size, inter)),
    ):
        want = (experts, -(-rows // bn), -(-cols // bk))
        if tuple(scale.shape) != want or scale.dtype != torch.float32:
            raise ValueError(f"{name}_scale must be float32 {want}, got {scale.dtype} {tuple(scale.shape)}")
        if bk % GROUP_SIZE and bk < cols:
            raise ValueError(
                f"block_size[1]={bk} must be a multiple of {GROUP_SIZE} or span {name}'s K={cols}"
            )
    return tokens, hidden_size, inter, experts


def _fake_quantize(rows: torch.Tensor) -> torch.Tensor:
    return dequantize_per_token_group(*quantize_per_token_group(rows), dtype=rows.dtype)


@register_kernel("moe", "experts_fp8", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def fused_experts_fp8_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    block_size: BlockSize = WEIGHT_BLOCK,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * Expert_{topk_ids[:, k]}(hidden) with dequantised fp8 experts."""
    experts = check_fp8_experts_args(
        hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_size
    )[3]

    def expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_weight(w13[e], w13_scale[e], block_size, hidden.dtype),
            dequantize_weight(w2[e], w2_scale[e], block_size, hidden.dtype),
        )

    requantize = _fake_quantize if quantize_activations else None
    return routed_experts_loop(hidden, topk_weights, topk_ids, experts, expert_weights, requantize=requantize)
