"""The FP8 skinny GEMM (2-16 tokens on tensor cores, `gemm/fp8_skinny_triton.py`) on the CPU, under Triton's
interpreter, against the weight-only reference, and its off switch. Cases and tolerances as in
`test_kernels_fp8_gemm.py` (activations stay unquantised, as in the one-token GEMV)."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels_fp8_gemm import GEMM_CASES, PER_CHANNEL_BLOCK, TOL, _gemm_case, _rel_err
from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels import arrival_counters
from tokenspeed.kernels.gemm.fp8_dispatch import fused_decode_max_tokens, select_fp8_gemm_by_batch
from tokenspeed.kernels.gemm.fp8_gemv_triton import fp8_gemv_triton
from tokenspeed.kernels.gemm.fp8_reference import fp8_gemm_reference
from tokenspeed.kernels.gemm.fp8_skinny_triton import SkinnyConfig, skinny_shapes
from tokenspeed.kernels.quant.fp8 import quantize_weight_block

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("m", "n", "k", "block_size"),
    [*[c for c in GEMM_CASES if 1 < c[0] <= 16], (16, 40, 256, (8, 128)), (3, 64, 2200, (64, 128)),
     (2, 32, 2048, PER_CHANNEL_BLOCK)],  # K split over up to 8 programs, the last one short
)
def test_fp8_skinny_gemm_matches_reference(
    dtype: torch.dtype, m: int, n: int, k: int, block_size: tuple[int, int]
) -> None:
    """2-16 tokens go to the tensor-core skinny GEMM (activations unquantised), at every launch shape,
    split-K ones included (the last program of a row block sums the partials and resets its counter)."""
    x, w8, scales, bias = _gemm_case(m, n, k, block_size, dtype)
    want = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size, bias=bias.float())
    for config in [None, *skinny_shapes()]:
        got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config)
        assert got.dtype == dtype and got.shape == (m, n)
        assert _rel_err(got, want) < TOL[dtype], config
    assert arrival_counters.all_at_rest()  # every launch reset them
    logits = fp8_gemv_triton(x.view(1, m, k), w8, scales, block_size=block_size, bias=bias, out_dtype=torch.float32)
    assert logits.shape == (1, m, n) and _rel_err(logits[0], want) < TOL[dtype]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [(16, 128), PER_CHANNEL_BLOCK])
@pytest.mark.parametrize("config", [SkinnyConfig(16, 1, 2), SkinnyConfig(16, 2, 2, split_k=2)])
def test_fp8_skinny_fused_decode_forms_match_the_unfused_path(
    dtype: torch.dtype, block_size: tuple[int, int], config: SkinnyConfig
) -> None:
    """2-16 tokens with the decode layer's fused forms: RMSNorm prologue, SiLU-and-mul over gate/up halves
    (with a bias on both) and the residual epilogue, each against the reference kernels run one after the
    other, whole K and split over two programs (the up rows' partials summed like the gate rows')."""
    from tokenspeed.kernels.activation.reference import silu_and_mul_reference
    from tokenspeed.kernels.norm.rms_reference import rms_norm_reference

    gen = torch.Generator().manual_seed(12)
    m, n, k, eps = 5, 32, 640, 1e-6
    w8, scales = quantize_weight_block(torch.randn(2 * n, k, generator=gen), block_size)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    bias = torch.randn(2 * n, generator=gen).to(dtype)
    res = torch.randn(m, n, generator=gen).to(dtype)

    def gemm(inp: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_gemm_reference(inp.float(), w, s, block_size=block_size,
                                  bias=None if b is None else b.float()).to(dtype)  # fmt: skip

    normed = rms_norm_reference(x, norm_w, eps)
    got = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=config, norm_weight=norm_w, eps=eps)
    assert got.shape == (m, 2 * n) and _rel_err(got, gemm(normed, w8, scales)) < TOL[dtype]
    got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config, norm_weight=norm_w,
                          eps=eps, silu_mul=True)  # fmt: skip
    want = silu_and_mul_reference(gemm(normed, w8, scales, bias))
    assert got.shape == (m, n) and _rel_err(got, want) < 4 * TOL[dtype]
    w_out, s_out = quantize_weight_block(torch.randn(n, k, generator=gen), block_size)
    got = fp8_gemv_triton(x, w_out, s_out, block_size=block_size, config=config, residual=res)
    assert _rel_err(got, (gemm(x, w_out, s_out).float() + res.float()).to(dtype)) < TOL[dtype]
    assert arrival_counters.all_at_rest()


def test_fused_skinny_switch_keeps_the_fused_forms_at_one_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TOKENSPEED_FP8_SKINNY_FUSED=0` (or the skinny GEMM's own switch) leaves 2-16 tokens unfused."""
    assert fused_decode_max_tokens(16) == 16
    monkeypatch.setenv("TOKENSPEED_FP8_SKINNY_FUSED", "0")
    assert fused_decode_max_tokens(16) == 1
    monkeypatch.delenv("TOKENSPEED_FP8_SKINNY_FUSED")
    monkeypatch.setenv("TOKENSPEED_FP8_SKINNY", "0")
    assert fused_decode_max_tokens(select_fp8_gemm_by_batch(platform="cuda", dtype=torch.bfloat16).max_small_tokens) == 1


def test_skinny_switch_sends_two_to_sixteen_tokens_back_to_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_FP8_SKINNY", "0")
    cuda = select_fp8_gemm_by_batch(platform="cuda", dtype=torch.bfloat16)
    assert cuda.kernel_for(1).name == "triton_gemv" and cuda.kernel_for(2).name == "scaled_mm"
