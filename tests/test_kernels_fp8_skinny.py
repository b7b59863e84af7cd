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
    # A fused form (here the residual add) takes the one-token kernel, a program per token; the skinny GEMM has none.
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, residual=res)
    assert _rel_err(got, (want.to(dtype).float() + res.float()).to(dtype)) < TOL[dtype]
    with pytest.raises(ValueError, match="no fused forms"):
        fp8_gemv_triton(x, w8, scales, block_size=block_size, config=SkinnyConfig(16, 1, 2), residual=res)


@interpreted
@pytest.mark.parametrize("block_size", [(64, 128), PER_CHANNEL_BLOCK])
def test_fp8_skinny_tma_tiles_give_the_pointer_loads_bits(block_size: tuple[int, int]) -> None:
    """Every TMA launch shape against the same shape with pointer loads, bit for bit, with and without a bias,
    at an uneven K (the last box hangs over it; split-K ranges start inside the weight)."""
    import dataclasses

    from tokenspeed.kernels.gemm.weight_tma import tma_fits

    m, n, k = 3, 64, 1168
    x, w8, scales, bias = _gemm_case(m, n, k, block_size, torch.float16)
    forms = [dict(), dict(bias=bias)]
    tma_shapes = [c for c in skinny_shapes() if c.tma]
    assert tma_shapes and tma_fits(w8, 64, 128)
    for config in tma_shapes:
        for form in forms:
            got = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=config, **form)
            want = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=dataclasses.replace(config, tma=False),
                                   **form)
            assert torch.equal(got, want), (config, sorted(form))
    assert arrival_counters.all_at_rest()


def test_skinny_switch_sends_two_to_sixteen_tokens_back_to_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_FP8_SKINNY", "0")
    cuda = select_fp8_gemm_by_batch(platform="cuda", dtype=torch.bfloat16)
    assert cuda.kernel_for(1).name == "triton_gemv" and cuda.kernel_for(2).name == "scaled_mm"
