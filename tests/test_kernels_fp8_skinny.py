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
from tokenspeed.kernels.activation.reference import silu_and_mul_reference
from tokenspeed.kernels.activation.silu_triton import silu_and_mul_triton
from tokenspeed.kernels.gemm.fp8_dispatch import select_fp8_gemm_by_batch
from tokenspeed.kernels.gemm.fp8_gemv_triton import fp8_gemv_triton
from tokenspeed.kernels.gemm.fp8_reference import fp8_gemm_reference
from tokenspeed.kernels.gemm.fp8_skinny_triton import SkinnyConfig, skinny_shapes
from tokenspeed.kernels.norm.rms_reference import rms_norm_reference

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
    split-K ones included (the last program of a row block sums the partials and resets its counter). K = 300
    ends inside a 256-wide step: its last group has no scale column (NaNs lie past the scales; seen failing
    when the skinny GEMM read one)."""
    x, w8, scales, bias = _gemm_case(m, n, k, block_size, dtype)
    want = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size, bias=bias.float())
    for config in [None, *skinny_shapes()]:
        got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config)
        assert got.dtype == dtype and got.shape == (m, n)
        assert _rel_err(got, want) < TOL[dtype], config
    assert arrival_counters.all_at_rest()  # every launch reset them
    logits = fp8_gemv_triton(x.view(1, m, k), w8, scales, block_size=block_size, bias=bias, out_dtype=torch.float32)
    assert logits.shape == (1, m, n) and _rel_err(logits[0], want) < TOL[dtype]


FUSED_CASES = [(2, 64, 256, (64, 128)), (5, 40, 300, (8, 128)), (3, 64, 2200, (64, 128)), (16, 32, 2048, PER_CHANNEL_BLOCK)]


def _fused_shapes(halved: bool) -> list[SkinnyConfig | None]:
    """None (the table or tuner) and every launch shape; the SiLU-and-mul form halves a program's rows, and a
    dot needs 16."""
    return [None, *(c for c in skinny_shapes() if not halved or c.block_n // 2 >= 16)]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k", "block_size"), FUSED_CASES)
def test_fp8_skinny_silu_mul_matches_the_unfused_path(
    dtype: torch.dtype, m: int, n: int, k: int, block_size: tuple[int, int]
) -> None:
    """The SiLU-and-mul form over a `[2n, k]` gate-then-up weight, at every launch shape (split-K ones sum both
    halves' partials): the reference's silu(gate) * up, and the unfused path (the skinny GEMM, then the
    activation kernel) to within the dot's rounding."""
    x, w8, scales, bias = _gemm_case(m, 2 * n, k, block_size, dtype)
    gate_up = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size, bias=bias.float()).to(dtype)
    want = silu_and_mul_reference(gate_up.float())
    for config in _fused_shapes(halved=True):
        got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config, silu_mul=True)
        assert got.dtype == dtype and got.shape == (m, n)
        assert _rel_err(got, want) < 4 * TOL[dtype], config
        unfused = silu_and_mul_triton(fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config))
        assert _rel_err(got, unfused) < TOL[dtype], config
    assert arrival_counters.all_at_rest()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k", "block_size"), FUSED_CASES)
def test_fp8_skinny_norm_and_residual_forms_match_the_reference(
    dtype: torch.dtype, m: int, n: int, k: int, block_size: tuple[int, int]
) -> None:
    """The RMSNorm prologue (each program recomputes its tokens' RMS; rounded as `rms_norm_reference`) and the
    residual epilogue (round(round(x W^T) + residual)), at every launch shape: split-K programs all normalise,
    and the last to arrive adds the residual once."""
    x, w8, scales, bias = _gemm_case(m, n, k, block_size, dtype)
    gen = torch.Generator().manual_seed(m + k)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    res = torch.randn(m, n, generator=gen).to(dtype)
    normed_x = rms_norm_reference(x, norm_w, 1e-6)
    want_norm = fp8_gemm_reference(normed_x.float(), w8, scales, block_size=block_size, bias=bias.float())
    want_res = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size, bias=bias.float()).to(dtype)
    want_res = (want_res.float() + res.float()).to(dtype)
    for config in _fused_shapes(halved=False):
        got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config, norm_weight=norm_w,
                              eps=1e-6)
        assert _rel_err(got, want_norm) < 4 * TOL[dtype], config
        got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config, residual=res)
        assert _rel_err(got, want_res) < TOL[dtype], config
    assert arrival_counters.all_at_rest()


@interpreted
@pytest.mark.parametrize("block_size", [(64, 128), PER_CHANNEL_BLOCK])
def test_fp8_skinny_tma_tiles_give_the_pointer_loads_bits(block_size: tuple[int, int]) -> None:
    """Every TMA launch shape against the same shape with pointer loads, bit for bit, in every fused form, at
    an uneven K (the last box hangs over it; split-K ranges start inside the weight)."""
    import dataclasses

    from tokenspeed.kernels.gemm.weight_tma import tma_fits

    m, n, k = 3, 64, 1168
    x, w8, scales, bias = _gemm_case(m, 2 * n, k, block_size, torch.float16)
    gen = torch.Generator().manual_seed(k)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.float16)
    res = torch.randn(m, 2 * n, generator=gen).to(torch.float16)
    forms = [dict(bias=bias), dict(norm_weight=norm_w, eps=1e-6), dict(silu_mul=True), dict(residual=res)]
    tma_shapes = [c for c in skinny_shapes() if c.tma]
    assert tma_shapes and tma_fits(w8, 64, 128)
    for config in tma_shapes:
        for form in forms:
            if form.get("silu_mul") and config.block_n // 2 < 16:
                continue
            got = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=config, **form)
            want = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=dataclasses.replace(config, tma=False),
                                   **form)
            assert torch.equal(got, want), (config, sorted(form))
    assert arrival_counters.all_at_rest()


def test_skinny_switch_sends_two_to_sixteen_tokens_back_to_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_FP8_SKINNY", "0")
    cuda = select_fp8_gemm_by_batch(platform="cuda", dtype=torch.bfloat16)
    assert cuda.kernel_for(1).name == "triton_gemv" and cuda.kernel_for(2).name == "scaled_mm"
