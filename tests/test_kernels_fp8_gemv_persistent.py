"""The persistent one-token FP8 GEMV (`fp8_gemv_persistent_triton.py`) against the references, interpreted.

Shapes have more row tiles than programs (132 a nominal SM off the GPU), so
each program walks several tiles and the first-iteration x preparation is
carried through the loop. Tolerance 2e-3 (fp16 activations): one rounding of
the output, and the fp16 products and runs one rounding each (2^-11).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.gemm.fp8_gemv_persistent_triton import Fp8PersistentConfig, persistent_shapes
from tokenspeed.kernels.gemm.fp8_gemv_triton import fp8_gemv_triton
from tokenspeed.kernels.gemm.fp8_reference import fp8_gemm_reference
from tokenspeed.kernels.quant.fp8 import PER_CHANNEL_BLOCK, quantize_weight_block

pytest.importorskip("triton")

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__, slow=True)

TOL = 2e-3
DTYPE = torch.float16
WALKING = Fp8PersistentConfig(block_n=2, programs_per_sm=1, num_warps=4, stages=3)  # 2-row tiles: several a program


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@interpreted
@pytest.mark.parametrize(
    ("n", "k", "block_size"),
    [(600, 256, (16, 128)), (530, 200, (128, 128)), (301, 160, PER_CHANNEL_BLOCK), (288, 384, (32, 256))],
)
def test_persistent_gemv_matches_the_reference(n: int, k: int, block_size: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w8, scales = quantize_weight_block(torch.randn(n, k, generator=gen), block_size)
    x = torch.randn(2, k, generator=gen).to(DTYPE)
    bias = torch.randn(n, generator=gen).to(DTYPE)
    want = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size, bias=bias.float())
    for config in (WALKING, *persistent_shapes()):
        got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config)
        assert got.dtype == DTYPE and got.shape == (2, n)
        assert _rel_err(got, want) < TOL, config


@interpreted
@pytest.mark.parametrize("block_size", [(16, 128), PER_CHANNEL_BLOCK])
def test_persistent_gemv_fused_decode_forms_match_the_unfused_path(block_size: tuple[int, int]) -> None:
    """RMSNorm prologue, SiLU-and-mul and the residual epilogue against the reference kernels in sequence."""
    from tokenspeed.kernels.activation.reference import silu_and_mul_reference
    from tokenspeed.kernels.norm.rms_reference import rms_norm_reference

    gen = torch.Generator().manual_seed(5)
    n, k, eps = 320, 384, 1e-6
    w8, scales = quantize_weight_block(torch.randn(2 * n, k, generator=gen), block_size)
    x = (torch.randn(3, k, generator=gen) * 3).to(DTYPE)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(DTYPE)
    res = torch.randn(3, n, generator=gen).to(DTYPE)

    def gemv(inp: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return fp8_gemm_reference(inp.float(), w, s, block_size=block_size).to(DTYPE)

    normed = rms_norm_reference(x, norm_w, eps)
    got = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=WALKING, norm_weight=norm_w, eps=eps)
    assert _rel_err(got, gemv(normed, w8, scales)) < TOL
    got = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=WALKING, norm_weight=norm_w, eps=eps,
                          silu_mul=True)  # fmt: skip
    assert got.shape == (3, n) and _rel_err(got, silu_and_mul_reference(gemv(normed, w8, scales))) < 4 * TOL
    w_out, s_out = quantize_weight_block(torch.randn(n, k, generator=gen), block_size)
    got = fp8_gemv_triton(x, w_out, s_out, block_size=block_size, config=WALKING, residual=res)
    want = (gemv(x, w_out, s_out).float() + res.float()).to(DTYPE)
    assert _rel_err(got, want) < TOL


@interpreted
def test_persistent_gemv_keeps_fp16_runs_in_range_for_any_activation_scale() -> None:
    """x is scaled by a power of two per program: huge, tiny, outlier and zero rows stay accurate."""
    from tokenspeed.kernels.norm.rms_reference import rms_norm_reference

    gen = torch.Generator().manual_seed(3)
    n, k, block_size = 300, 1024, (16, 128)
    w8, scales = quantize_weight_block(torch.randn(n, k, generator=gen) * 40.0, block_size)  # scales ~0.4
    x = torch.randn(4, k, generator=gen)
    x[0] *= 6e4 / x[0].abs().max()  # runs of 16 x 448 x 6e4 would overflow fp16 unscaled
    x[1] *= 1e-4
    x[1, 7] = 6e4  # one outlier over values 1e9 times smaller
    x[2] = 0.0
    x = x.to(DTYPE)
    got = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=WALKING, out_dtype=torch.float32)
    want = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size)
    for row in (0, 1, 3):
        assert _rel_err(got[row], want[row]) < TOL, row
    assert not got[2].any()
    norm_w = torch.full((k,), 2e3, dtype=DTYPE)  # normalisation makes small inputs large
    small = (torch.randn(2, k, generator=gen) * 1e-3).to(DTYPE)
    got = fp8_gemv_triton(small, w8, scales, block_size=block_size, config=WALKING, out_dtype=torch.float32,
                          norm_weight=norm_w, eps=1e-6)  # fmt: skip
    want = fp8_gemm_reference(rms_norm_reference(small, norm_w, 1e-6).float(), w8, scales, block_size=block_size)
    assert _rel_err(got, want) < TOL


def test_persistent_gemv_refuses_what_it_does_not_serve() -> None:
    w8, scales = quantize_weight_block(torch.randn(64, 128), (16, 128))
    with pytest.raises(ValueError, match="persistent"):
        fp8_gemv_triton(torch.randn(1, 128), w8, scales, block_size=(16, 128), config=WALKING)  # fp32 activations
