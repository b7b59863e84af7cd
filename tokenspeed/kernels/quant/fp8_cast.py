"""e4m3 in Triton: the cast of every kernel that writes fp8 (saturate, round to nearest even) and the widening of
every kernel that multiplies fp8 tiles on tensor cores (`widen_fp8`).

Why not `x.to(tl.float8e4nv)` alone: on the GPU that cast is
`cvt.rn.satfinite`, exactly the rounding of `fp8.cast_to_fp8`, but Triton's
interpreter (the CPU tests) truncates instead and carries no saturation, so
an interpreted kernel would disagree with the reference in the last bit. So
the value is first rounded onto the e4m3 grid in fp32, which makes the cast
exact on both: normal values keep 3 mantissa bits (add half an ulp, plus
one when the kept lsb is odd, then clear the dropped bits); values below
2^-6 sit on the subnormal grid of 2^-9, rounded by adding and subtracting
1.5 * 2^14 (whose fp32 ulp is 2^-9), then given x's sign bit (so -0.0001
becomes -0, as torch rounds it; Triton's negation, 0 - x, would lose it). About ten integer and float operations
an element, in kernels that are bound by memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed.kernels.triton_launch import interpreter_active

FP8_MAX = tl.constexpr(448.0)
_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6
_SUBNORMAL_ROUNDER = tl.constexpr(24576.0)  # 1.5 * 2^14: fp32 ulp 2^-9, the e4m3 subnormal step


@triton.jit
def to_fp8(x):
    """fp32 `x` -> `tl.float8e4nv` (e4m3fn), saturating at +-448, ties to even."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    magnitude = tl.abs(x)
    tiny = (magnitude + _SUBNORMAL_ROUNDER) - _SUBNORMAL_ROUNDER
    tiny = (tiny.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(
        tl.float32, bitcast=True
    )  # x's sign, -0 too
    return tl.where(magnitude >= _MIN_NORMAL, normal, tiny).to(tl.float8e4nv)


@triton.jit
def quantize_heads(
    x, scale_ptr, offs_h, NUM_HEADS: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_STRIDE: tl.constexpr
):
    """Rows `[BLOCK_H, D]` of heads `offs_h` -> e4m3, each times the reciprocal of its head's scale (if any)."""
    x = x.to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_h * SCALE_STRIDE, mask=offs_h < NUM_HEADS, other=1.0)
        x = x * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    return to_fp8(x)


# Compiled for a GPU (the widening below is inline PTX, which the interpreter cannot run).
_COMPILED = tl.constexpr(not interpreter_active())


@triton.jit
def widen_fp8(x, dtype: tl.constexpr, TRANSPOSED_USE: tl.constexpr):
    """A cached tile as `dtype` for a tensor-core dot; e4m3 widens exactly (every e4m3 value is an fp16 value).

    Why fp16 for dots on fp8 data: one `cvt.rn.f16x2.e4m3x2` widens two
    values, while bf16 has no direct conversion (Triton goes e4m3 -> fp16 ->
    bf16, one slow conversion per value: on the H200 it capped fp8 decode
    attention near half the copy bandwidth). So kernels run their fp8 dots in
    fp16 (the other operand converted once) and widen here. Other dtypes
    (fp32 for the IEEE tests, tiles that are not fp8) take Triton's cast.

    `TRANSPOSED_USE`: the tile is the dot's operand along its rows (the
    values of P V, whose reduction runs over cached positions), which
    Triton would otherwise load from shared memory one byte at a time (8-bit
    data has no transposing `ldmatrix`). Marking the conversion impure keeps
    Triton from moving it after that load: the tile is widened in registers
    and stored as fp16, which `ldmatrix.trans` then reads.
    """
    if x.dtype == tl.float8e4nv and dtype == tl.float16 and _COMPILED:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r",
            [x],
            dtype=tl.float16,
            is_pure=not TRANSPOSED_USE,
            pack=4,
        )
    return x.to(dtype)


@triton.jit
def to_f16_saturated(x):
    """`x` as fp16, clamped to +-65504 (a query beyond fp16's range saturates instead of becoming inf).

    On the GPU one `cvt.rn.satfinite.f16x2.f32` converts two values, where a clamp in fp32 took two min/max
    instructions a value before the conversion: in the skinny FP8 GEMM's loop, which converts its activation
    tile once per warp and K group, those were 256 of 716 instructions a step (`sass_loops "skinny"`; 456
    now, and the w8a16 MoE decode tile's 409 -> 280). On an H100 that made Llama-3.1-8B FP8 decode 11% faster
    at 2 rows and 10% at 16 (`benchmarks/results/h100/wave2/satfinite_2026-12-07/`). Same values for every
    finite and infinite input (rounded to nearest even, then held at +-65504); a NaN stays NaN, where the
    clamp made it -65504.
    """
    if _COMPILED:
        return tl.inline_asm_elementwise(
            "cvt.rn.satfinite.f16x2.f32 $0, $2, $1;", "=r,r,r", [x.to(tl.float32)], dtype=tl.float16,
            is_pure=True, pack=2,
        )
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
