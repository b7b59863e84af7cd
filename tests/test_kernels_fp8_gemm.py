"""FP8 formats, quantisation and the FP8 linear kernels (`quant.*`, `gemm.fp8`) on the CPU.

The references are checked against first principles (what a scale, a block,
a dequantised weight is), the Triton kernels against the references under
Triton's interpreter (see `tests/triton_interpreter.py`), at tiny shapes.

Tolerances, and why:
- quantisation is compared bit for bit (fp8 codes and fp32 scales): the
  kernels follow the reference's rounding exactly (`quant/fp8_cast.py`);
- the GEMV keeps activations as they are and the GEMM quantises them exactly
  like `fp8_gemm_reference(..., quantize_activations=True)`, so with fp32
  activations both differ from their reference only by fp32 summation order
  (relative error < 1e-5); fp16 adds one rounding of the output (2e-3), and
  the GEMV's fp16 products and lanes one rounding each (2^-11, same bound);
- against the weight-only reference, the GEMM's activation quantisation
  costs ~2^-5 relative (e4m3 keeps 4 significant bits: a value's rounding
  error is at most 2^-4 of it, ~2^-5.6 on average): bounded by 0.05.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before anything imports triton
    fresh_process_test,
    interpreted,
)
from tokenspeed.kernels.gemm import FP8_GEMV_MAX_TOKENS
from tokenspeed.kernels.gemm import fp8_scaled_mm as fp8_scaled_mm_module
from tokenspeed.kernels.gemm.fp8_dispatch import select_fp8_gemm_by_batch
from tokenspeed.kernels.gemm.fp8_gemm_triton import Fp8GemmTiles, fp8_gemm_triton
from tokenspeed.kernels.gemm.fp8_gemv_triton import Fp8GemvConfig, fp8_gemv_triton
from tokenspeed.kernels.gemm.fp8_reference import fp8_gemm_reference
from tokenspeed.kernels.gemm.fp8_scaled_mm import (
    BLOCKWISE,
    ROWWISE,
    cublas_format,
    cublas_fp8_gemm,
    probe_cublas,
)
from tokenspeed.kernels.gemm.weight_tma import tma_fits
from tokenspeed.kernels.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_AMAX,
    PER_CHANNEL_BLOCK,
    cast_to_fp8,
    check_weight_scale,
    dequantize_per_token_group,
    dequantize_weight,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_block,
    quantize_weight_per_channel,
)
from tokenspeed.kernels.quant.fp8_cast import to_fp8
from tokenspeed.kernels.quant.quantize_triton import (
    quantize_per_token_group_triton,
    quantize_per_token_triton,
)
from tokenspeed.kernels.registry import Band, select_kernel, set_kernel_override

triton = pytest.importorskip("triton")  # imported here, after tests.triton_interpreter set the mode
tl = pytest.importorskip("triton.language")

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__, slow=True)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _interesting_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours and their fp32 neighbours, and wide noise."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    up, down = mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(float("-inf")))
    gen = torch.Generator().manual_seed(0)
    noise = torch.cat([torch.randn(4096, generator=gen) * s for s in (1e-3, 3e-2, 1.0, 60.0, 2e3)])
    extremes = torch.tensor([500.0, -500.0, 448.5, -1e30, 0.0, -0.0, -1e-4, 2.0**-10])
    return torch.cat([codes, mids, up, down, noise, extremes])


# --- formats and references -----------------------------------------------------------------


def test_cast_rounds_to_nearest_even_and_saturates() -> None:
    values = torch.tensor([2.0**-9 * 1.5, 2.0**-9 * 2.5, 1.0625, 1.1875, 460.0, -1e9, -1e-4])
    want = torch.tensor([2.0**-9 * 2, 2.0**-9 * 2, 1.0, 1.25, FP8_MAX, -FP8_MAX, -0.0])
    got = cast_to_fp8(values)
    assert got.dtype == FP8_DTYPE and torch.equal(got.float(), want)
    assert torch.signbit(got.float()[-1])


def test_per_token_group_scales_map_each_group_amax_to_448() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 300, generator=gen) * torch.logspace(-2, 2, 300)
    x[1, :128] = 0.0  # an all-zero group
    q, scales = quantize_per_token_group(x)
    assert q.shape == x.shape and q.dtype == FP8_DTYPE and scales.shape == (3, 3)  # 300 = 2 groups + a tail
    groups = torch.nn.functional.pad(x, (0, 84)).view(3, 3, 128)
    assert torch.equal(scales, groups.abs().amax(-1).clamp(min=MIN_AMAX) / FP8_MAX)
    nonzero = scales > MIN_AMAX / FP8_MAX
    peaks = torch.nn.functional.pad(q.float(), (0, 84)).view(3, 3, 128).abs().amax(-1)
    assert (peaks[nonzero] == FP8_MAX).all() and not q.float()[1, :128].any()
    # Round to nearest: a value is off by at most half the e4m3 step at its magnitude (2^-3 relative,
    # 2^-9 absolute below 2^-6), in units of its group's scale.
    scaled = x / scales.repeat_interleave(128, -1)[:, :300]
    step = 2.0 ** (torch.floor(torch.log2(scaled.abs().clamp(min=2.0**-6))) - 3)
    error = (q.float() - scaled).abs()
    assert (error <= step / 2 * (1 + 1e-5)).all()
    assert torch.allclose(
        dequantize_per_token_group(q, scales), q.float() * scales.repeat_interleave(128, -1)[:, :300]
    )


@pytest.mark.parametrize("block_size", [(128, 128), (32, 64), (1, 96)])
def test_weight_block_quantisation_round_trips_within_half_a_step(block_size: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2, 70, 96, generator=gen)  # leading dim: experts
    q, scales = quantize_weight_block(w, block_size)
    bn, bk = block_size
    assert q.dtype == FP8_DTYPE and scales.shape == (2, -(-70 // bn), -(-96 // bk))
    blocks = torch.nn.functional.pad(w, (0, -96 % bk, 0, -70 % bn)).view(
        2, -(-70 // bn), bn, -(-96 // bk), bk
    )
    assert torch.equal(scales, blocks.abs().amax(dim=(-3, -1)) / FP8_MAX)
    restored = dequantize_weight(q, scales, block_size)
    expanded = scales.repeat_interleave(bn, 1)[:, :70].repeat_interleave(bk, 2)[:, :, :96]
    assert ((restored - w).abs() <= expanded * FP8_MAX * 2.0**-4 + 1e-12).all()  # half a step of 2^-3 * 2^e
    check_weight_scale(q[0], scales[0], block_size)


def test_per_channel_is_the_block_spanning_k() -> None:
    w = torch.randn(5, 33, generator=torch.Generator().manual_seed(3))
    q, scales = quantize_weight_per_channel(w)
    assert scales.shape == (5, 1)
    assert torch.equal(scales[:, 0], w.abs().amax(1) / FP8_MAX)
    assert torch.equal(dequantize_weight(q, scales, (1, 33)), q.float() * scales)


def test_malformed_weight_scales_are_refused() -> None:
    q = torch.zeros(256, 384, dtype=FP8_DTYPE)
    good = torch.ones(2, 3)
    check_weight_scale(q, good, (128, 128))
    for bad, why in (
        (torch.ones(2, 2), r"must be float32 \(2, 3\)"),
        (torch.ones(3, 2), r"must be float32 \(2, 3\)"),
        (torch.ones(2, 3, dtype=torch.float16), "must be float32"),
    ):
        with pytest.raises(ValueError, match=why):
            check_weight_scale(q, bad, (128, 128))
    with pytest.raises(ValueError, match="2-D"):
        check_weight_scale(q.float(), good, (128, 128))
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_gemm_reference(torch.zeros(1, 384), q, torch.ones(2, 6), block_size=(128, 64))
    with pytest.raises(ValueError, match="features"):
        fp8_gemm_reference(torch.zeros(1, 100), q, good, block_size=(128, 128))


@pytest.mark.parametrize("block_size", [(128, 128), (16, 128), (1, 200), (40, 200)])
def test_reference_is_linear_on_the_dequantised_weight(block_size: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(4)
    w8, scales = quantize_weight_block(torch.randn(40, 200, generator=gen), block_size)
    x, bias = torch.randn(3, 200, generator=gen), torch.randn(40, generator=gen)
    dequantised = (
        w8.float()
        * scales.repeat_interleave(block_size[0], 0)[:40].repeat_interleave(block_size[1], 1)[:, :200]
    )
    want = F.linear(x, dequantised, bias)
    assert torch.equal(fp8_gemm_reference(x, w8, scales, block_size=block_size, bias=bias), want)
    emulated = fp8_gemm_reference(x, w8, scales, block_size=block_size, bias=bias, quantize_activations=True)
    assert 1e-3 < _rel_err(emulated, want) < 0.05


# --- Triton kernels against the references --------------------------------------------------


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, to_fp8(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


@interpreted
def test_triton_cast_is_bit_exact_with_the_reference() -> None:
    x = _interesting_values()
    y = torch.empty(x.shape, dtype=FP8_DTYPE)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(_bits(y), _bits(cast_to_fp8(x)))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 300), (2, 3, 128), (1, 1000)])
def test_per_token_group_triton_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])).to(dtype)
    x.view(-1, shape[-1])[0, :128] = 0.0
    q, scales = quantize_per_token_group_triton(x)
    want_q, want_scales = quantize_per_token_group(x)
    assert q.shape == x.shape and scales.shape == want_scales.shape
    assert torch.equal(scales, want_scales) and torch.equal(_bits(q), _bits(want_q))
    rows = x.view(-1, shape[-1])
    q, scales = quantize_per_token_group_triton(rows, column_major_scales=True)  # cuBLAS's 1 x 128 layout
    assert scales.stride() == (1, rows.shape[0]) and torch.equal(scales, want_scales.view(rows.shape[0], -1))
    assert torch.equal(_bits(q), _bits(want_q.view(rows.shape)))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 300), (2, 3, 128), (1, 2500)])
def test_per_token_triton_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    x = (torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])).to(dtype)
    x.view(-1, shape[-1])[0] = 0.0
    q, scales = quantize_per_token_triton(x)
    want_q, want_scales = quantize_per_token(x)
    assert scales.shape == (*shape[:-1], 1) and torch.equal(scales, want_scales)
    assert torch.equal(_bits(q), _bits(want_q))
    assert torch.equal(want_scales.flatten(), x.float().abs().amax(-1).clamp(min=MIN_AMAX).flatten() / FP8_MAX)


GEMM_CASES = [  # (tokens, N, K, block_size)
    (5, 40, 300, (16, 128)),
    (3, 64, 256, (128, 128)),
    (1, 33, 200, (1, 200)),
    (20, 48, 384, (48, 256)),
    (2, 24, 96, (24, 96)),  # per tensor
    (4, 40, 160, PER_CHANNEL_BLOCK),
    (3, 24, 256, (8, 128)),  # row blocks narrower than a GEMV program's rows: it takes fewer
]


def _gemm_case(
    m: int, n: int, k: int, block_size: tuple[int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations, fp8 weights, their scales (`followed_by_nans`) and a bias."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w8, scales = quantize_weight_block(torch.randn(n, k, generator=gen), block_size)
    return torch.randn(m, k, generator=gen).to(dtype), w8, followed_by_nans(scales), torch.randn(n, generator=gen).to(dtype)


def followed_by_nans(t: torch.Tensor) -> torch.Tensor:
    """`t`, contiguous, in a buffer whose next values are NaN: a kernel that reads past it (a scale of a K group
    wholly past K, say) shows it in its output instead of reading whatever happens to lie there."""
    padded = torch.full((t.numel() + 64,), float("nan"), dtype=t.dtype)
    padded[: t.numel()] = t.reshape(-1)
    return padded[: t.numel()].view(t.shape)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k", "block_size"), GEMM_CASES)
def test_fp8_gemm_triton_matches_reference(
    dtype: torch.dtype, m: int, n: int, k: int, block_size: tuple[int, int]
) -> None:
    x, w8, scales, bias = _gemm_case(m, n, k, block_size, dtype)
    want = fp8_gemm_reference(
        x.float(), w8, scales, block_size=block_size, bias=bias.float(), quantize_activations=True
    )
    for tiles in (Fp8GemmTiles(16, 16, 4, 1), Fp8GemmTiles(32, 64, 4, 2, group_m=2)):
        got = fp8_gemm_triton(x, w8, scales, block_size=block_size, bias=bias, tiles=tiles)
        assert got.dtype == dtype and got.shape == (m, n)
        assert _rel_err(got, want) < TOL[dtype]
    weight_only = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size, bias=bias.float())
    assert _rel_err(got, weight_only) < 0.05
    logits = fp8_gemm_triton(x, w8, scales, block_size=block_size, out_dtype=torch.float32)
    assert logits.dtype == torch.float32


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k", "block_size"), GEMM_CASES)
def test_fp8_gemv_triton_matches_reference(
    dtype: torch.dtype, m: int, n: int, k: int, block_size: tuple[int, int]
) -> None:
    x, w8, scales, bias = _gemm_case(m, n, k, block_size, dtype)
    want = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size, bias=bias.float())
    configs = [
        None,
        Fp8GemvConfig(block_n=8, groups=2, num_warps=4, stages=2),
        Fp8GemvConfig(block_n=16, groups=1, num_warps=4, stages=2, f16_math=False),
        Fp8GemvConfig(block_n=4, groups=4, num_warps=4, stages=1),
    ]
    for config in configs:
        got = fp8_gemv_triton(x, w8, scales, block_size=block_size, bias=bias, config=config)
        assert got.dtype == dtype and got.shape == (m, n)
        assert _rel_err(got, want) < TOL[dtype], config
    got = fp8_gemv_triton(x.view(1, m, k), w8, scales, block_size=block_size, out_dtype=torch.float32)
    assert got.shape == (1, m, n) and got.dtype == torch.float32


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [(16, 128), PER_CHANNEL_BLOCK])
@pytest.mark.parametrize("f16_math", [True, False])
def test_fp8_gemv_fused_decode_forms_match_the_unfused_path(
    dtype: torch.dtype, block_size: tuple[int, int], f16_math: bool
) -> None:
    """RMSNorm prologue, SiLU-and-mul over gate/up halves and the residual epilogue, each against the
    reference kernels run one after the other (what the decode layer runs when they are not fused)."""
    from tokenspeed.kernels.activation.reference import silu_and_mul_reference
    from tokenspeed.kernels.gemm.fp8_dispatch import fits_silu_mul
    from tokenspeed.kernels.norm.rms_reference import rms_norm_reference

    gen = torch.Generator().manual_seed(11)
    m, n, k, eps = 3, 32, 384, 1e-6
    w8, scales = quantize_weight_block(torch.randn(2 * n, k, generator=gen), block_size)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    res = torch.randn(m, n, generator=gen).to(dtype)
    config = Fp8GemvConfig(block_n=8, groups=2, num_warps=4, stages=1, f16_math=f16_math)

    def gemv(inp: torch.Tensor) -> torch.Tensor:
        return fp8_gemm_reference(inp.float(), w8, scales, block_size=block_size).to(dtype)

    normed = rms_norm_reference(x, norm_w, eps)
    got = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=config, norm_weight=norm_w, eps=eps)
    assert _rel_err(got, gemv(normed)) < TOL[dtype]
    assert fits_silu_mul(2 * n, k, block_size)
    got = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=config, norm_weight=norm_w, eps=eps,
                          silu_mul=True)
    assert got.shape == (m, n) and _rel_err(got, silu_and_mul_reference(gemv(normed))) < 4 * TOL[dtype]
    w_out, s_out = quantize_weight_block(torch.randn(n, k, generator=gen), block_size)
    got = fp8_gemv_triton(x, w_out, s_out, block_size=block_size, config=config, residual=res)
    want = fp8_gemm_reference(x.float(), w_out, s_out, block_size=block_size).to(dtype).float() + res.float()
    assert _rel_err(got, want.to(dtype)) < TOL[dtype]
    mixed, mixed_scales = quantize_weight_block(torch.randn(48, k, generator=gen), (32, 128))  # halves of 24 rows
    assert not fits_silu_mul(48, k, (32, 128))
    with pytest.raises(ValueError, match="silu_mul"):
        fp8_gemv_triton(x, mixed, mixed_scales, block_size=(32, 128), silu_mul=True)


@interpreted
@pytest.mark.parametrize("f16_math", [True, False])
def test_fp8_gemv_keeps_fp16_lanes_in_range_for_any_activation_scale(f16_math: bool) -> None:
    """The fp16 loop scales activations by a power of two per program: huge, tiny and zero rows stay exact."""
    gen = torch.Generator().manual_seed(3)
    n, k, block_size = 32, 1024, (16, 128)
    w8, scales = quantize_weight_block(torch.randn(n, k, generator=gen) * 40.0, block_size)  # scales ~0.4
    x = torch.randn(4, k, generator=gen)
    x[0] *= 3e4 / x[0].abs().max()  # lanes of 8 steps x 448 x 0.4 x 3e4 would overflow fp16 unscaled
    x[1] *= 1e-4
    x[1, 7] = 6e4  # one outlier over values 1e9 times smaller
    x[2] = 0.0
    x = x.to(torch.float16)
    config = Fp8GemvConfig(block_n=16, groups=1, num_warps=4, stages=1, f16_math=f16_math)
    got = fp8_gemv_triton(x, w8, scales, block_size=block_size, config=config, out_dtype=torch.float32)
    want = fp8_gemm_reference(x.float(), w8, scales, block_size=block_size)
    for row in (0, 1, 3):
        assert _rel_err(got[row], want[row]) < TOL[torch.float16], row
    assert not got[2].any()
    # With the RMSNorm prologue the peak comes from x times the norm weight, scaled by the row's rstd:
    # a large norm weight makes small inputs large after normalisation.
    from tokenspeed.kernels.norm.rms_reference import rms_norm_reference

    norm_w = torch.full((k,), 2e3, dtype=torch.float16)
    small = (torch.randn(2, k, generator=gen) * 1e-3).to(torch.float16)
    got = fp8_gemv_triton(small, w8, scales, block_size=block_size, config=config, out_dtype=torch.float32,
                          norm_weight=norm_w, eps=1e-6)
    want = fp8_gemm_reference(rms_norm_reference(small, norm_w, 1e-6).float(), w8, scales, block_size=block_size)
    assert got.isfinite().all() and _rel_err(got, want) < TOL[torch.float16]


@interpreted
@pytest.mark.parametrize("block_size", [(8, 128), PER_CHANNEL_BLOCK])  # with per-channel scales N is uneven
@pytest.mark.parametrize("f16_math", [True, False])
def test_fp8_gemv_tma_steps_give_the_pointer_loads_bits(block_size: tuple[int, int], f16_math: bool) -> None:
    """Weight steps through a TMA descriptor (zeros past the edges) against each thread's masked loads,
    bit for bit in every fused form, at uneven N and K (the last box hangs over both; with SiLU-and-mul
    the gate box over the up rows, whose outputs are not stored)."""
    gen = torch.Generator().manual_seed(5)
    m, n, k, eps = 2, 24, 208, 1e-6
    w8, scales = quantize_weight_block(torch.randn(2 * n, k, generator=gen), block_size)
    assert tma_fits(w8, 16, 128) and not tma_fits(w8[:, 1:], 16, 128) and not tma_fits(w8, 16, 512)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.float16)
    res = torch.randn(m, 2 * n, generator=gen).to(torch.float16)
    forms = [dict(), dict(norm_weight=norm_w, eps=eps), dict(norm_weight=norm_w, eps=eps, silu_mul=True),
             dict(residual=res)]
    def run(tma: bool) -> list[torch.Tensor]:
        config = Fp8GemvConfig(block_n=16, groups=1, num_warps=4, stages=2, f16_math=f16_math, tma=tma)
        return [fp8_gemv_triton(x, w8, scales, block_size=block_size, config=config, **form) for form in forms]

    want = run(False)
    for form, got, expected in zip(forms, run(True), want, strict=True):
        assert torch.equal(got, expected), sorted(form)
    assert _rel_err(want[0], fp8_gemm_reference(x.float(), w8, scales, block_size=block_size)) < TOL[torch.float16]


# --- registry ---------------------------------------------------------------------------------


def test_registry_picks_gemv_small_gemm_large_reference_on_cpu() -> None:
    cpu = select_fp8_gemm_by_batch(platform="cpu", dtype=torch.float32)
    assert cpu.small.name == cpu.large.name == "reference"
    cuda = select_fp8_gemm_by_batch(platform="cuda", dtype=torch.bfloat16)
    assert (cuda.small.name, cuda.large.name) == ("triton_gemv", "scaled_mm")
    assert cuda.kernel_for(1).name == cuda.kernel_for(FP8_GEMV_MAX_TOKENS).name == "triton_gemv"
    assert cuda.kernel_for(FP8_GEMV_MAX_TOKENS + 1).name == "scaled_mm"
    assert FP8_GEMV_MAX_TOKENS == 16
    fp16 = select_fp8_gemm_by_batch(platform="cuda", dtype=torch.float16)  # cuBLAS serves bf16 only
    assert (fp16.small.name, fp16.large.name) == ("triton_gemv", "triton")
    assert select_kernel("gemm", "fp8", platform="cuda", dtype=torch.bfloat16).name == "triton"
    for mode in ("per_token_group", "per_token"):
        spec = select_kernel("quant", mode, platform="cuda", dtype=torch.bfloat16)
        assert spec.name == "triton" and spec.band == Band.PORTABLE
    try:
        set_kernel_override("gemm", "fp8", "reference")  # the off switch
        forced = select_fp8_gemm_by_batch(platform="cuda", dtype=torch.bfloat16)
        assert forced.small.name == forced.large.name == "reference"
    finally:
        set_kernel_override("gemm", "fp8", None)


def test_scaled_mm_takes_the_formats_cublas_has_and_leaves_the_rest_to_triton() -> None:
    assert cublas_format(6144, 4096, (128, 128), torch.bfloat16) == BLOCKWISE
    assert cublas_format(6144, 4096, PER_CHANNEL_BLOCK, torch.bfloat16) == ROWWISE
    assert cublas_format(6144, 4096, (6144, 4096), torch.bfloat16) == ROWWISE  # per tensor
    assert cublas_format(6144, 4096, (64, 128), torch.bfloat16) is None  # row blocks of fused parts
    assert cublas_format(6144, 4096, (128, 128), torch.float32) is None  # fp32 logits
    assert cublas_format(6000, 4096, (128, 128), torch.bfloat16) is None
    assert cublas_format(4096, 4224, (128, 128), torch.bfloat16) is None  # 33 K blocks: not a multiple of 4
    assert cublas_format(4104, 4104, PER_CHANNEL_BLOCK, torch.bfloat16) is None  # not a multiple of 16


@interpreted
@pytest.mark.parametrize("block_size", [PER_CHANNEL_BLOCK, (16, 256), (64, 256)], ids=["channel", "rows16", "tensor"])
def test_scaled_mm_rowwise_operands_on_the_cpu(block_size: tuple[int, int]) -> None:
    """The rowwise call as cuBLAS gets it (torch's CPU `_scaled_mm` takes rowwise scales too)."""
    gen = torch.Generator().manual_seed(11)
    w8, scales = quantize_weight_block(torch.randn(64, 256, generator=gen), block_size)
    x = torch.randn(5, 256, generator=gen).to(torch.float16)
    bias = torch.randn(64, generator=gen).to(torch.bfloat16)
    try:
        got = cublas_fp8_gemm(x, w8, scales, ROWWISE, bias)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch build has no CPU _scaled_mm with rowwise scales: {exc}")
    xq, xs = quantize_per_token(x)
    want = fp8_gemm_reference(xq.float() * xs, w8, scales, block_size=block_size, bias=bias.float())
    assert got.dtype == torch.bfloat16 and _rel_err(got, want) < 4e-3  # bf16 output rounding


@interpreted
def test_cublas_probe_accepts_right_scaling_and_rejects_a_misread_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        works = probe_cublas(ROWWISE, torch.device("cpu"))  # torch's CPU _scaled_mm takes rowwise scales
    except NotImplementedError as exc:
        pytest.skip(f"this torch build has no CPU _scaled_mm with rowwise scales: {exc}")
    assert works

    def scales_read_transposed(x2, weight, weight_scale, fmt, bias):  # noqa: ANN001, ANN202
        return cublas_fp8_gemm(x2.flip(0), weight, weight_scale, fmt, bias)

    monkeypatch.setattr(fp8_scaled_mm_module, "cublas_fp8_gemm", scales_read_transposed)
    assert not probe_cublas(ROWWISE, torch.device("cpu"))


def test_dispatch_calls_the_kernel_for_the_token_count() -> None:
    x, w8, scales, bias = _gemm_case(3, 16, 128, (128, 128), torch.float32)
    dispatch = select_fp8_gemm_by_batch(platform="cpu", dtype=torch.float32)
    got = dispatch(x, w8, scales, block_size=(128, 128), bias=bias)
    assert torch.equal(got, fp8_gemm_reference(x, w8, scales, block_size=(128, 128), bias=bias))
