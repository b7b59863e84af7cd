"""Triton FP8 weight-streaming GEMV (`gemm.fp8`, name "triton_gemv"): 1-16 tokens, fp8 weights, bf16 activations.

At decode a projection is a stream of weight bytes and fp8 halves them; the
activation row is a few KB and stays in its dtype (no quantisation step, no
extra launch, and more accurate than the tensor-core GEMM). As in
`gemv_triton.py`, a program owns BLOCK_N whole output rows, streams them in
`[BLOCK_N, 128 * GROUPS]` steps and writes finished outputs (no split-K, no
second kernel). Each program serves one token (grid axis 1); 2-16 tokens
take the tensor-core skinny GEMM (`fp8_skinny_triton.py`), which streams the
weights once for all of them, and more tokens the FP8 GEMMs
(`FP8_GEMV_MAX_TOKENS`). The fused forms below are the one-token kernel's.

Where the time goes: an fp8 byte is one weight, so this kernel does twice
the arithmetic per byte of the bf16 GEMV, and at the H200's ~17 bytes per
clock per SM (4.3 TB/s over 132 SMs at 1.98 GHz) the instruction issue, not
memory, was the limit of the first version (about 9 instructions per weight
byte: widen to fp32, scale, FMA; 0.3-0.5 of the copy bandwidth). Two inner
loops (`F16_MATH`):
- fp16 (default): the weight widens to fp16 with one instruction per pair
  (exactly) and is multiplied into fp16 lanes with packed FMAs, one per pair;
  each lane accumulates one product per K step (at most `STEPS`), and the
  lanes are summed in fp32 once at the end. To keep those lanes in fp16's
  range, the activations are pre-multiplied by their K group's weight scale
  and by a power of two `f` chosen per program from a first pass over the
  row (max |x| times the largest scale of the program's row block), so that
  no lane can exceed 2^14 (fp16 tops out at 65504); the result is divided by
  `f` again. Per product that is one fp16 rounding (2^-11), below the bf16
  output's own (2^-9), and values more than 2^24 below the row's largest
  flush to zero.
- fp32: widen to fp32 and FMA into an fp32 tile (exact products, fp32 sums;
  about 1.5x the instructions); always for fp32 activations.

Launch shape (`choose_config`): the shape measured for the form on this GPU
model where a table ships for it (`fp8_gemv_shapes.py`), else fixed rules
from `benchmarks/gemv_stack.py`, which times every shape of `launch_shapes`
the way a decode step runs it (32 layers' weights back to back in one CUDA
graph, PDL on). On an H100
(2026-12-06, us per launch at Llama-3.1-8B's forms qkv / o / gate_up /
down): 8 rows x 2048 in the fp16 loop 11.6 / 7.7 / 43.0 / 22.3, and for
down's K of 14336, 8 x 1024 in the fp32 loop 21.6; the best of 15 shapes
per form summed to 82.7 us a layer, these to 83.9. Three things were tried
and measured out:
- the best shape per fused form in that stack (qkv 16 x 1024, o 16 x 2048
  with 8 warps: about 1.3 us a layer faster there, in two runs) was not
  faster end to end: Llama-3.1-8B FP8 bs1 3.569 / 3.508 ms against 3.513 /
  3.493 ms for these shapes, alternating on one H100
  (`benchmarks/results/h100/wave2/fp8_2026-12-06d/`);
- timing the shapes on first use, each launched alone (`LaunchTuner`):
  alone, a launch pays its ramp-up and the L2 flush that no decode step
  pays, and its picks came out 4-8 us a layer slower than these in the
  graph; in one run it picked a tensor-core shape for a form and the FP8
  step took 4.66 ms (3.66 ms the run before, same card);
- a tensor-core loop (swap-AB, the weight rows as the dot's M side, fp16
  dots): 1.3x (gate_up) to 4x (down) slower than the best shape, in the
  graph (`benchmarks/results/h100/wave2/fp8_2026-12-06/`).

Weight steps through TMA (`Fp8GemvConfig.tma`, `weight_tma.py`): in the
sm_90 machine code the main loop keeps its arithmetic; the weight copies
become two TMA requests a step and the mbarrier waits add a few instructions
(gate/up at 32 x 256 in the fp32 loop: 562 a step against 532; `sass_loops`).
On an H100 in the decode graph (`gemv_stack.py --per-channel`) the TMA
shapes that have a pointer twin in the sweep ran 0.3-10% slower than it
(gate/up 32 x 256: 42.99 against 42.54 us), and the best TMA shape of each
form was 6-24% slower than its best shape (gate/up 40.58 us;
`benchmarks/results/h100/wave2/tma_gemv_2026-12-07/`): the copies were not
what held these loops back there. Two stay in the sweep for
the H200, whose best gate/up shape they are; no built-in rule takes them.

Scales: a program's rows lie in one row block (BLOCK_N divides bn), so a
K group's block scale is the same for all of them and multiplies the
activations (GROUPS products a step, not BLOCK_N * 128); per-channel and
per-tensor scales (a block spanning K, `ROW_SCALE`) multiply each row's
finished sum instead.

Fused forms, the decode layer's as in `gemv_triton.py` (without them an FP8
layer ran two norm kernels and an activation kernel per layer, and each GEMV
waited on them): an RMSNorm prologue (each program recomputes the row's RMS
and normalises x on load, rounded as `rms_norm_reference`), SiLU-and-mul (a
program streams gate rows n and up rows n + N, each with its own row block's
scales: `fits_silu_mul`) and a residual epilogue, rounded step by step as the
unfused path.

Launched with programmatic dependent launch on Hopper (`kernels/pdl.py`). As in
`gemv_triton.py`, a program asks for its first weight step before it waits
for the previous kernel (weights never depend on it); the later steps are
pipelined by the compiler, and the RMS and the peak of x come from one pass
over x. (The first version waited, then made two passes over x before its
first weight load: microseconds of latency on a 4096 x 4096 projection that
streams in about four.) Whatever else a program reads that no earlier kernel
writes (its block scales, per-channel scales, bias) it requests before the
wait too, and the residual right after it, so that no program ends on a
dependent memory round trip: in the graph of `benchmarks/gemv_stack.py` an
FP8 layer went from 86.6 to 83.6 us (per-channel scales) and from 84.3 to
81.9 us (128 x 128 blocks), and Llama-3.1-8B FP8 bs1 from 3.545-3.589 to
3.432-3.438 ms TPOT, three runs each alternating on one H100
(`benchmarks/results/h100/wave2/fp8_row_terms_early_2026-12-07/`). There too,
gate/up with per-channel scales ran fastest at 4 whole rows of 4096 a
program, one step (41.1 us against 44.6 at 8 x 2048; 3.369-3.445 against
3.462-3.570 ms TPOT, three pairs on one H100).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.activation.silu_triton import silu_mul_rounded
from tokenspeed.kernels.gemm import FP8_GEMV_MAX_TOKENS
from tokenspeed.kernels.gemm.fp8_dispatch import fits_silu_mul
from tokenspeed.kernels.gemm.fp8_gemv_shapes import form_key, gpu_name_of, table_for
from tokenspeed.kernels.gemm.fp8_reference import check_fp8_gemm_args
from tokenspeed.kernels.gemm.fp8_skinny_triton import SKINNY_BLOCK_M, SkinnyConfig, fp8_skinny_gemm
from tokenspeed.kernels.gemm.weight_tma import load_weight_tile, weight_descriptor
from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.quant.fp8 import GROUP_SIZE, WEIGHT_BLOCK, BlockSize, scales_whole_rows
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2

# The largest magnitude a sum of LANE_RUN fp16 lanes may reach (headroom 4x under fp16's 65504).
_LANE_LIMIT = tl.constexpr(16384.0)
LANE_RUN = tl.constexpr(16)


@dataclass(frozen=True, slots=True)
class Fp8GemvConfig:
    """Launch shape of `_fp8_gemv_kernel`: BLOCK_N rows, `groups` K groups of 128 per step; `tma`: weight
    steps through the tensor memory accelerator where the weight fits (`weight_tma.py`)."""

    block_n: int
    groups: int
    num_warps: int
    stages: int
    f16_math: bool = True
    tma: bool = False


def launch_shapes(k: int) -> list[Fp8GemvConfig]:
    """The launch shapes worth timing for rows of `k` (`benchmarks/gemv_stack.py` sweeps them; the tests run each).

    Steps of 8-16 rows x 1024-2048 values (pipelined) keep 128-256 bytes per
    thread in flight; 4096-wide single steps suit K = 4096 (one pass, no
    loop, all of it requested before the PDL wait). The fp32 loop at 4-32
    rows of 512-2048 values: two fp32 tiles of 8 x 2048 (SiLU-and-mul) would spill.
    """
    groups = next_power_of_2(triton.cdiv(k, GROUP_SIZE))
    return [
        Fp8GemvConfig(block_n=8, groups=min(16, groups), num_warps=4, stages=3),
        Fp8GemvConfig(block_n=16, groups=min(8, groups), num_warps=4, stages=3),
        Fp8GemvConfig(block_n=8, groups=min(32, groups), num_warps=8, stages=2),
        Fp8GemvConfig(block_n=4, groups=min(32, groups), num_warps=4, stages=2),
        Fp8GemvConfig(block_n=16, groups=min(16, groups), num_warps=8, stages=2),
        Fp8GemvConfig(block_n=8, groups=min(8, groups), num_warps=4, stages=3, f16_math=False),
        Fp8GemvConfig(block_n=16, groups=min(4, groups), num_warps=4, stages=4, f16_math=False),
        Fp8GemvConfig(block_n=32, groups=min(2, groups), num_warps=4, stages=4, f16_math=False),
        Fp8GemvConfig(block_n=4, groups=min(16, groups), num_warps=4, stages=3, f16_math=False),
        # Around the H200's picks (`benchmarks/results/h200/fp8/2026-12-06b/`): more rows, shorter steps.
        Fp8GemvConfig(block_n=32, groups=min(4, groups), num_warps=4, stages=3),
        Fp8GemvConfig(block_n=16, groups=min(4, groups), num_warps=4, stages=4),
        Fp8GemvConfig(block_n=16, groups=min(8, groups), num_warps=8, stages=3),
        Fp8GemvConfig(block_n=32, groups=min(2, groups), num_warps=8, stages=4, f16_math=False),
        # Around the H200's per-channel picks (`benchmarks/results/h200/fp8/2026-12-07/`): gate/up at
        # 32-64 rows of 128-256 values, qkv and o at 4-8 rows of 2048. Not yet swept on an H200; on an
        # H100 none beat the rules by more than 0.3 us (`benchmarks/results/h100/wave2/gemv_launch_shapes_2026-12-07/`).
        Fp8GemvConfig(block_n=32, groups=min(1, groups), num_warps=4, stages=6, f16_math=False),
        Fp8GemvConfig(block_n=64, groups=min(1, groups), num_warps=8, stages=6, f16_math=False),
        Fp8GemvConfig(block_n=32, groups=min(2, groups), num_warps=4, stages=4),
        Fp8GemvConfig(block_n=64, groups=min(2, groups), num_warps=8, stages=3),
        Fp8GemvConfig(block_n=4, groups=min(16, groups), num_warps=4, stages=3),
        Fp8GemvConfig(block_n=8, groups=min(16, groups), num_warps=4, stages=2),
        # Weight steps through TMA (module docstring): the H200's gate/up shape (32 x 256) four and six deep,
        # the best two of five on an H100, where none beat the pointer loads; kept for the H200's sweep.
        Fp8GemvConfig(block_n=32, groups=min(2, groups), num_warps=4, stages=4, f16_math=False, tma=True),
        Fp8GemvConfig(block_n=32, groups=min(2, groups), num_warps=4, stages=6, f16_math=False, tma=True),
    ]


@cache  # called by every eager launch: the table lookup and its check run once per form
def choose_config(k: int, *, silu_mul: bool = False, block_size: BlockSize = WEIGHT_BLOCK, norm: bool = False,
                  residual: bool = False, gpu_name: str = "") -> Fp8GemvConfig:
    """The launch shape for rows of `k` in a fused form: the shape measured for it on this GPU model
    (`fp8_gemv_shapes.py`), else the rules measured on an H100 in a decode step's graph (module docstring):
    8 rows x 2048 in the fp16 loop, 8 x 1024 in the fp32 loop for long rows (down_proj's 14336),
    and gate/up with per-channel scales (SiLU-and-mul, a block spanning K) 4 rows x 4096 in one step.
    ValueError for a table's shape that is not one of `launch_shapes` (the shapes the tests run)."""
    whole_rows = scales_whole_rows(block_size, k)
    key = form_key(k, norm=norm, residual=residual, silu_mul=silu_mul, whole_rows=whole_rows)
    measured = table_for(gpu_name).get(key)
    if measured is not None:
        config = Fp8GemvConfig(**measured)
        if config not in launch_shapes(k):
            raise ValueError(f"FP8 GEMV shapes table for {gpu_name or 'this device'}: {key} names {config}, "
                             "which is not one of the kernel's launch_shapes")
        return config
    groups = next_power_of_2(triton.cdiv(k, GROUP_SIZE))
    if silu_mul and whole_rows and k <= 4096:  # gate/up with per-channel scales: 4 whole rows (module docstring)
        return Fp8GemvConfig(block_n=4, groups=min(32, groups), num_warps=4, stages=2)
    if k > 8192:
        return Fp8GemvConfig(block_n=8, groups=min(8, groups), num_warps=4, stages=3, f16_math=False)
    return Fp8GemvConfig(block_n=8, groups=min(16, groups), num_warps=4, stages=3)


@triton.jit
def _load_x(x_row, offs, mask, norm_w_ptr, rstd, HAS_NORM: tl.constexpr):
    """Activations at `offs`, RMS-normalised as `rms_norm_reference` rounds them when HAS_NORM."""
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_NORM:
        nw = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
        x = (nw * normed).to(x.dtype)
    return x


@triton.jit
def _round_like_unfused(acc, acc_up, x_ptr, SILU_MUL: tl.constexpr):
    """The GEMM output (and with SILU_MUL, silu(gate) * up) rounded step by step to the activation dtype,
    as the unfused path rounds it (GEMM output, activation, product), back in fp32 for the residual add."""
    act_dtype = x_ptr.dtype.element_ty
    acc = acc.to(act_dtype).to(tl.float32)
    if SILU_MUL:
        acc = silu_mul_rounded(acc, acc_up.to(act_dtype).to(tl.float32), act_dtype).to(tl.float32)
    return acc


@triton.jit
def _step_scales(scale_row, up_scale_row, k0, offs_g, K: tl.constexpr, GROUP_K: tl.constexpr,
                 SCALE_BK: tl.constexpr, ROW_SCALE: tl.constexpr, SILU_MUL: tl.constexpr):
    """A step's GROUPS block scales of the gate rows and of the up rows (SILU_MUL); ones for ROW_SCALE.
    Weights' metadata: they never depend on the previous kernel, so the first step's load before the PDL wait."""
    group_start = k0 + offs_g * GROUP_K
    if ROW_SCALE:
        g = tl.full([offs_g.shape[0]], 1.0, tl.float32)
        return g, g
    g = tl.load(scale_row + group_start // SCALE_BK, mask=group_start < K, other=0.0)
    gu = g
    if SILU_MUL:
        gu = tl.load(up_scale_row + group_start // SCALE_BK, mask=group_start < K, other=0.0)
    return g, gu


@triton.jit
def _step_x(x_row, k0, x_cols, norm_w_ptr, rstd, f, g, gu, K: tl.constexpr, BLOCK_K: tl.constexpr,
            HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr):
    """A step's activations `[BLOCK_K]` times f and the step's scales of the gate rows `g` (and of the up
    rows `gu` with SILU_MUL), folded in so that the weights need no scaling."""
    x = _load_x(x_row, k0 + x_cols, (k0 + x_cols) < K, norm_w_ptr, rstd, HAS_NORM).to(tl.float32)
    xu = x
    if SILU_MUL:
        xu = x * (gu * f)[:, None]
    x = x * (g * f)[:, None]
    return tl.reshape(x, [BLOCK_K]), tl.reshape(xu, [BLOCK_K])


@triton.jit
def _row_terms(ws_ptr, bias_ptr, offs_n, n_mask, N: tl.constexpr, stride_wsn, SCALE_BN: tl.constexpr,
               ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
    """The epilogue's per-row weight terms of the gate rows and of the up rows (SILU_MUL): row scales
    (ones unless ROW_SCALE) and bias (zeros without). Weights' metadata: loaded before the PDL wait, so
    that no program ends on a dependent memory round trip."""
    scale = tl.full(offs_n.shape, 1.0, tl.float32)
    scale_up = scale
    bias = tl.zeros(offs_n.shape, tl.float32)
    bias_up = bias
    if ROW_SCALE:
        scale = tl.load(ws_ptr + (offs_n // SCALE_BN) * stride_wsn, mask=n_mask, other=0.0)
        if SILU_MUL:
            scale_up = tl.load(ws_ptr + ((offs_n + N) // SCALE_BN) * stride_wsn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SILU_MUL:
            bias_up = tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return scale, scale_up, bias, bias_up


@triton.jit
def _lane_sum(lanes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Runs of LANE_RUN fp16 lanes summed in fp16 first (within a thread), then in fp32."""
    runs = tl.sum(tl.reshape(lanes, [BLOCK_N, BLOCK_K // LANE_RUN, LANE_RUN]), 2, dtype=tl.float16)
    return tl.sum(runs.to(tl.float32), 1)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    ws_ptr,
    bias_ptr,
    norm_w_ptr,
    res_ptr,
    out_ptr,
    eps,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_rm,
    stride_om,
    N: tl.constexpr,
    K: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP_K: tl.constexpr,
    STAGES: tl.constexpr,
    F16_MATH: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr,
    USE_PDL: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    BLOCK_K: tl.constexpr = GROUPS * GROUP_K
    STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    scales_per_row = (K + SCALE_BK - 1) // SCALE_BK
    pid_n = tl.program_id(0)
    token = tl.program_id(1)
    row0 = pid_n * BLOCK_N
    offs_n = row0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, GROUPS)
    n_mask = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = rows + N * stride_wn  # SILU_MUL: the up rows n + N of a [2N, K] weight
    # The first weight step before the wait and the pass over x (module docstring). Only the first:
    # prefetching every step into registers took away the compiler's pipelining through shared memory
    # and spilled registers (`compile_check`).
    w_first = load_weight_tile(rows, w_desc, row0, 0, offs_k, n_mask, K, EVEN, USE_TMA)
    wu_first = w_first
    if SILU_MUL:
        wu_first = load_weight_tile(up_rows, w_desc, N + row0, 0, offs_k, n_mask, K, EVEN, USE_TMA)
    # The scales too (the row block's largest for f, the first step's): off the chain after the wait.
    scale_row = ws_ptr + (row0 // SCALE_BN) * stride_wsn  # the program's row block
    up_scale_row = ws_ptr + ((row0 + N) // SCALE_BN) * stride_wsn
    s_peak = 1.0
    if F16_MATH and not ROW_SCALE:  # SCALE_COLS: the row block's scales, padded to a power of two
        offs_s = tl.arange(0, SCALE_COLS)
        s_peak = tl.max(tl.load(scale_row + offs_s, mask=offs_s < scales_per_row, other=0.0), 0)
        if SILU_MUL:
            s_peak = tl.maximum(
                s_peak, tl.max(tl.load(up_scale_row + offs_s, mask=offs_s < scales_per_row, other=0.0), 0)
            )
    g, gu = _step_scales(scale_row, up_scale_row, 0, offs_g, K, GROUP_K, SCALE_BK, ROW_SCALE, SILU_MUL)
    row_s, row_su, bias, bias_up = _row_terms(ws_ptr, bias_ptr, offs_n, n_mask, N, stride_wsn, SCALE_BN,
                                              ROW_SCALE, HAS_BIAS, SILU_MUL)
    if USE_PDL:  # see kernels/pdl.py: wait for the previous kernel before reading x
        gdc_wait()
        gdc_launch_dependents()
    res = 0.0
    if HAS_RESIDUAL:  # requested now, used at the end: no round trip there
        res = tl.load(res_ptr + token.to(tl.int64) * stride_rm + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    x_row = x_ptr + token.to(tl.int64) * stride_xm
    x_cols = offs_g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]  # [GROUPS, GROUP_K] of a step
    rstd = 0.0
    x_peak = 0.0
    if HAS_NORM or F16_MATH:  # one pass over x (K values from L2): the row's RMS and its largest magnitude
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        peak = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            xv = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            if HAS_NORM:
                squares += xv * xv
                xv *= tl.load(norm_w_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(xv))
        x_peak = tl.max(peak, 0)
        if HAS_NORM:  # each program recomputes the row's RMS, cheaper than a norm kernel
            rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
            # The normalised peak before its two roundings: < 1% over, under the bound's 4x headroom.
            x_peak *= rstd
    f = 1.0  # x is scaled by f in the fp16 loop, and the result divided by it
    if F16_MATH:  # the power of two that keeps every fp16 lane under _LANE_LIMIT (module docstring)
        x_peak *= s_peak
        bound: tl.constexpr = _LANE_LIMIT / (448.0 * STEPS * LANE_RUN)
        f = tl.exp2(tl.minimum(tl.floor(tl.log2(bound / tl.maximum(x_peak, 1e-30))), 100.0))
    # F16_MATH: fp16 lanes, one product per step each (module docstring); else fp32 products and sums.
    acc_dtype: tl.constexpr = tl.float16 if F16_MATH else tl.float32
    lanes = tl.zeros([BLOCK_N, BLOCK_K], dtype=acc_dtype)
    lanes_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=acc_dtype)
    xk, xuk = _step_x(x_row, 0, x_cols, norm_w_ptr, rstd, f, g, gu, K, BLOCK_K, HAS_NORM, SILU_MUL)
    lanes += w_first.to(acc_dtype) * xk.to(acc_dtype)[None, :]
    if SILU_MUL:
        lanes_up += wu_first.to(acc_dtype) * xuk.to(acc_dtype)[None, :]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):  # the other steps, pipelined by the compiler
        w = load_weight_tile(rows, w_desc, row0, k0, offs_k, n_mask, K, EVEN, USE_TMA)
        g, gu = _step_scales(scale_row, up_scale_row, k0, offs_g, K, GROUP_K, SCALE_BK, ROW_SCALE, SILU_MUL)
        xk, xuk = _step_x(x_row, k0, x_cols, norm_w_ptr, rstd, f, g, gu, K, BLOCK_K, HAS_NORM, SILU_MUL)
        lanes += w.to(acc_dtype) * xk.to(acc_dtype)[None, :]
        if SILU_MUL:
            wu = load_weight_tile(up_rows, w_desc, N + row0, k0, offs_k, n_mask, K, EVEN, USE_TMA)
            lanes_up += wu.to(acc_dtype) * xuk.to(acc_dtype)[None, :]
    if F16_MATH:
        acc = _lane_sum(lanes, BLOCK_N, BLOCK_K) / f
        acc_up = _lane_sum(lanes_up, BLOCK_N, BLOCK_K) / f
    else:
        acc = tl.sum(lanes, 1)
        acc_up = tl.sum(lanes_up, 1)
    acc = acc * row_s + bias
    acc_up = acc_up * row_su + bias_up
    if SILU_MUL or HAS_RESIDUAL:
        acc = _round_like_unfused(acc, acc_up, x_ptr, SILU_MUL) + res
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def _fitting_block_n(block_n: int, scale_bn: int, row_scale: bool) -> int:
    """BLOCK_N, halved until a program's rows lie in one row block of block scales."""
    while not row_scale and scale_bn % block_n:
        block_n //= 2
    return block_n


@register_kernel(
    "gemm",
    "fp8",
    name="triton_gemv",
    band=Band.PERFORMANT,
    platforms=("cuda",),
    dtypes=FLOAT_DTYPES,
    workload={"num_tokens": (1, FP8_GEMV_MAX_TOKENS)},
)
def fp8_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_size: BlockSize = WEIGHT_BLOCK,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Fp8GemvConfig | SkinnyConfig | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x `[..., K]` @ dequantised(weight)^T (+ bias) -> `[..., N]`; see `fp8_reference.fp8_gemm_reference`.

    The decode layer's fused forms, as in the bf16 GEMV (`gemv_triton.py`): `norm_weight` applies
    RMSNorm to x first, `silu_mul` treats the weight as `[2N, K]` gate then up rows and returns
    silu(gate) * up `[..., N]` (`fits_silu_mul` says which block scales allow it), `residual` is
    added to the result. `config` None: 2-16 tokens without fused forms take the skinny GEMM
    (`fp8_skinny_triton.py`), anything else the one-token kernel at `choose_config`'s launch shape (one
    program a token); a `SkinnyConfig` forces the skinny GEMM, an `Fp8GemvConfig` the one-token kernel.
    """
    n, k = check_fp8_gemm_args(x, weight, weight_scale, block_size)
    if weight.stride(-1) != 1:
        raise ValueError("the weight must be contiguous along K")
    row_scale = scales_whole_rows(block_size, k)
    if silu_mul:
        if not fits_silu_mul(n, k, block_size):
            raise ValueError(f"silu_mul needs gate and up rows in separate row blocks: {n} rows, block {block_size}")
        n //= 2
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    res = None if residual is None else residual.reshape(-1, n)
    scales = weight_scale.contiguous()
    fused = norm_weight is not None or res is not None or silu_mul
    if isinstance(config, SkinnyConfig) or (config is None and 1 < m <= SKINNY_BLOCK_M and not fused):
        if fused:
            raise ValueError("the skinny GEMM has no fused forms (norm, residual, silu_mul)")
        fp8_skinny_gemm(x2, weight, scales, out, block_size=block_size, bias=bias, config=config)
        return out.view(*x.shape[:-1], n)

    config = config or choose_config(k, silu_mul=silu_mul, block_size=block_size, norm=norm_weight is not None,
                                     residual=res is not None, gpu_name=gpu_name_of(x.device))
    block_n = _fitting_block_n(config.block_n, block_size[0], row_scale)
    block_k = config.groups * GROUP_SIZE
    f16_math = config.f16_math and x.dtype != torch.float32  # fp32 activations: exact products and sums
    w_desc = weight_descriptor(weight, block_n, block_k, config.tma)
    for_tensor(_fp8_gemv_kernel, x)[(triton.cdiv(n, block_n), m)](
        x2, weight, w_desc, scales, bias if bias is not None else out,
        norm_weight if norm_weight is not None else x2, res if res is not None else out, out, eps,
        x2.stride(0), weight.stride(0), scales.stride(0), res.stride(0) if res is not None else 0, out.stride(0),
        N=n, K=k, SCALE_BN=block_size[0], SCALE_BK=block_size[1], SCALE_COLS=next_power_of_2(scales.shape[1]),
        ROW_SCALE=row_scale,
        BLOCK_N=block_n, GROUPS=config.groups, GROUP_K=GROUP_SIZE, STAGES=config.stages, F16_MATH=f16_math,
        EVEN=n % block_n == 0 and k % block_k == 0, HAS_BIAS=bias is not None,
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=res is not None, SILU_MUL=silu_mul, USE_TMA=w_desc is not None,
        num_warps=config.num_warps, **pdl_launch_options(pdl_enabled(x.device)),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
