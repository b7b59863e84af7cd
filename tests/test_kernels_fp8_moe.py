"""FP8 routed experts (`moe.experts_fp8`) on the CPU: the reference from first principles, Triton against it.

The reference must be `moe.experts`' reference on the dequantised weights
(bit for bit: the same loop), and with `quantize_activations` within the
activation quantisation error of it (~2^-5, bounded by 0.05). The Triton
kernels run under the interpreter at tiny shapes (hidden 256, intermediate
128 or 160: a ragged N edge) in both operand precisions (weights widened
at decode tiles; fp8 x fp8 with quantised activations above), for block,
per-channel and non-square block scales; fp32 results then differ from the
reference only by summation order (1e-5), fp16 by roundings of the
intermediates (2e-3 relative, as the bf16 kernel's tests allow).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels_fp8_gemm import followed_by_nans
from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.moe.experts_fp8_reference import fused_experts_fp8_reference
from tokenspeed.kernels.moe.experts_fp8_triton import fused_experts_fp8_triton
from tokenspeed.kernels.moe.experts_reference import fused_experts_reference
from tokenspeed.kernels.moe.experts_triton import DECODE_TILES, TileConfig
from tokenspeed.kernels.quant.fp8 import PER_CHANNEL_BLOCK, dequantize_weight, quantize_weight_block
from tokenspeed.kernels.registry import select_kernel

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__, slow=True)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
TINY_TILES = TileConfig(block_m=16, block_n_up=32, block_n_down=64, block_k=128, num_warps=4, num_stages=1)
NARROW_TILES = TileConfig(block_m=16, block_n_up=16, block_n_down=32, block_k=64, num_warps=4, num_stages=1)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _fp8_experts(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, block_size: tuple[int, int], seed: int
) -> tuple[torch.Tensor, ...]:
    """(x, w13 fp8, w2 fp8, w13 scales, w2 scales, routing weights, ids) with k distinct experts per token."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13, s13 = quantize_weight_block(
        torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5, block_size
    )
    w2, s2 = quantize_weight_block(
        torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5, block_size
    )
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen).softmax(-1)
    return x, w13, w2, followed_by_nans(s13), followed_by_nans(s2), weights, ids


def test_reference_is_the_bf16_reference_on_dequantised_experts() -> None:
    x, w13, w2, s13, s2, weights, ids = _fp8_experts(5, 256, 128, 4, 2, (128, 128), seed=0)
    plain = fused_experts_reference(
        x, dequantize_weight(w13, s13, (128, 128)), dequantize_weight(w2, s2, (128, 128)), weights, ids
    )
    got = fused_experts_fp8_reference(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    assert torch.equal(got, plain)
    emulated = fused_experts_fp8_reference(
        x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, quantize_activations=True
    )
    assert 1e-3 < _rel_err(emulated, plain) < 0.05


def test_reference_refuses_malformed_scales_and_weights() -> None:
    x, w13, w2, s13, s2, weights, ids = _fp8_experts(2, 256, 128, 4, 2, (128, 128), seed=1)
    with pytest.raises(ValueError, match="w13_scale"):
        fused_experts_fp8_reference(x, w13, w2, weights, ids, w13_scale=s13[:, :1], w2_scale=s2)
    with pytest.raises(ValueError, match="w2_scale"):
        fused_experts_fp8_reference(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2.half())
    with pytest.raises(ValueError, match="float8"):
        fused_experts_fp8_reference(x, w13.float(), w2, weights, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="multiple of 128"):
        fused_experts_fp8_reference(
            x,
            w13,
            w2,
            weights,
            ids,
            w13_scale=torch.ones(4, 2, 4),
            w2_scale=torch.ones(4, 2, 2),
            block_size=(128, 64),
        )


def test_registry_serves_the_reference_on_cpu_and_triton_on_cuda() -> None:
    assert select_kernel("moe", "experts_fp8", platform="cpu", dtype=torch.float32).name == "reference"
    assert select_kernel("moe", "experts_fp8", platform="cuda", dtype=torch.bfloat16).name == "triton"


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("quantize_activations", [False, True])
@pytest.mark.parametrize(
    ("inter", "block_size", "tiles"),
    [
        (128, (128, 128), TINY_TILES),
        (160, (64, 128), NARROW_TILES),  # ragged N edge, row blocks narrower than the gate/up split
        (160, PER_CHANNEL_BLOCK, TINY_TILES),
    ],
    ids=["block", "narrow-block", "per-channel"],
)
def test_triton_fp8_experts_match_reference(
    dtype: torch.dtype, quantize_activations: bool, inter: int, block_size: tuple[int, int], tiles: TileConfig
) -> None:
    x, w13, w2, s13, s2, weights, ids = _fp8_experts(7, 256, inter, 6, 3, block_size, seed=inter)
    x = x.to(dtype)
    want = fused_experts_fp8_reference(
        x.float(), w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, block_size=block_size,
        quantize_activations=quantize_activations,
    )  # fmt: skip
    got = fused_experts_fp8_triton(
        x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, block_size=block_size, tiles=tiles,
        quantize_activations=quantize_activations,
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == x.shape
    # fp16 with quantised activations: the intermediate is rounded to fp16 before it is quantised
    # (the fp32 reference quantises it unrounded), which moves a few values by one e4m3 step.
    tol = TOL[dtype] * (5 if quantize_activations and dtype == torch.float16 else 1)
    assert _rel_err(got, want) < tol


@interpreted
def test_triton_default_precision_follows_the_tiles() -> None:
    """Decode tiles keep activations (exact against the weight-only reference); larger ones quantise them."""
    x, w13, w2, s13, s2, weights, ids = _fp8_experts(3, 256, 128, 4, 2, (128, 128), seed=3)
    weight_only = fused_experts_fp8_reference(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    emulated = fused_experts_fp8_reference(
        x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, quantize_activations=True
    )
    decode = fused_experts_fp8_triton(
        x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, tiles=DECODE_TILES
    )
    assert _rel_err(decode, weight_only) < TOL[torch.float32]
    medium = TileConfig(block_m=32, block_n_up=32, block_n_down=64, block_k=64, num_warps=4, num_stages=1)
    quantised = fused_experts_fp8_triton(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, tiles=medium)
    assert _rel_err(quantised, emulated) < TOL[torch.float32]
    empty = fused_experts_fp8_triton(x[:0], w13, w2, weights[:0], ids[:0], w13_scale=s13, w2_scale=s2)
    assert empty.shape == (0, 256)
