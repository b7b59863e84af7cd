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
    with pytest.raises(ValueError, match="no norm or residual forms"):
        fp8_gemv_triton(x, w8, scales, block_size=block_size, config=SkinnyConfig(16, 1, 2), residual=x[:, :n])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("m", "n", "k", "block_size"),
    [(2, 64, 256, (64, 128)), (5, 40, 300, (8, 128)), (3, 64, 2200, (64, 128)), (16, 32, 2048, PER_CHANNEL_BLOCK)],
)
def test_fp8_skinny_silu_mul_matches_the_unfused_path(
    dtype: torch.dtype, m: int, n: int, k: int, block_size: tuple[int, int]
) -> None:
    """The SiLU-and-mul form over a `[2n, k]` gate-then-up weight, at every launch shape (split-K ones sum both
    halves' partials): the reference's silu(gate) * up, and the unfused path (the skinny GEMM, then the
    activation kernel) to within the dot's rounding."""
    x, w8, scales, bias = _gemm_case(m, 2 * n, k, block_size, dtype)
    gate_up = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size, bias=bias.float()).to(dtype)
    want = silu_and_mul_reference(gate_up.float())
    for config in [None, *skinny_shapes()]:
        if config is not None and config.block_n // 2 < 16:
            continue  # the fused form halves a program's rows; a dot needs 16
        got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config, silu_mul=True)
        assert got.dtype == dtype and got.shape == (m, n)
        assert _rel_err(got, want) < 4 * TOL[dtype], config
        unfused = silu_and_mul_triton(fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config))
        assert _rel_err(got, unfused) < TOL[dtype], config
    assert arrival_counters.all_at_rest()


def test_skinny_switch_sends_two_to_sixteen_tokens_back_to_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_FP8_SKINNY", "0")
    cuda = select_fp8_gemm_by_batch(platform="cuda", dtype=torch.bfloat16)
    assert cuda.kernel_for(1).name == "triton_gemv" and cuda.kernel_for(2).name == "scaled_mm"
