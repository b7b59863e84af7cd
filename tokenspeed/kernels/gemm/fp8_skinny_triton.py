"""Triton FP8 skinny GEMM: 2-16 tokens against fp8 weights, on tensor cores, activations kept in bf16.

Below 17 tokens a projection is still a stream of weight bytes, but the
one-token GEMV (`fp8_gemv_triton.py`) would stream them once per token, and
the tensor-core GEMMs are shaped for compute: cuBLAS's block-scaled FP8
GEMM took 128 x 128 tiles at 4 tokens, plus an activation-quantisation
kernel, and read a Llama-3.1-8B layer's weights at 0.58 of the copy
bandwidth in a 4 x 32K decode step on an H100 (`fp8_e2e.py --sections
kv_long --profile`, 2026-12-06), 45% of that step.

So this kernel is the fp8 decode attention's inner loop
(`attention/decode_triton.py`) with weight rows in place of cached
positions: a program owns BLOCK_N whole output rows and streams them K
group (128 values) by K group; each tile widens from e4m3 to fp16 in registers
(`widen_fp8`, exact) and meets the step's activations, the tokens padded to
16 rows, in an fp16 dot with fp32 accumulation. Activations widen to fp16
exactly (bf16 has fewer mantissa bits), saturating past +-65504 as the
attention's query does; no quantisation step and no extra launch.

Scales: a K group lies in one K block of the weight's block scales, so
each group's product is scaled by its rows' scales of that block, in fp32,
whatever the row blocks (per-channel and per-tensor scales, blocks
spanning K, multiply the finished sum once). As the GEMV, a program asks
for its first weight tile before it waits on the previous kernel (PDL), and
the compiler pipelines the rest through shared memory (STAGES deep).

The decode layer's fused forms, as the one-token GEMV has them (for 2-16
row steps with `TOKENSPEED_FP8_SKINNY_FUSED=1`,
`fp8_dispatch.fp8_fused_decode_max_tokens`), each rounded as the unfused
path: an RMSNorm prologue (each program, each K split, recomputes its
tokens' RMS in one pass over x and normalises each group on load), a
residual epilogue (the row block's last program adds it once), and
SiLU-and-mul (`silu_mul`): a program streams BLOCK_N / 2 gate rows n and
the up rows n + N beside them (the same bytes a program as the plain GEMM
at the weight shape's launch), each group's activations converted once for
both dots, and writes silu(gate) * up as the activation kernel computes it
(`activation.silu_triton.silu_mul_rounded`). Per layer that is two norm
kernels, the activation kernel and their round trips fewer, and yet
Llama-3.1-8B FP8 ran 28-31% slower with them at 4 and 16 rows on an H100
(`benchmarks/results/h100/wave2/skinny_fused_2026-12-08/`; likely the prologue's
re-reading of m x K activations in every program and split): off by default.

Grid: BLOCK_N rows by `split_k` K ranges. Where a shape has too few row
blocks to fill the GPU (o_proj at 4096 rows: 64 programs of 64 rows), its
K is split: each program stores its fp32 partial, and the row block's last
program to arrive sums the partials in split order and writes the output
(`kernels/arrival_counters.py`); no second kernel. A step is `groups` K
groups of 128 (each its own dot, so block scales stay exact), 8-16 KB of
weights, three steps in flight. The launch shape: the one measured for the
weight shape on this GPU model where a table has it (`fp8_gemv_shapes.py`:
`benchmarks/fp8_skinny_stack.py --write-shapes` times every shape the way a
decode step runs them), else timed per weight shape on first use
(`kernels/autotune.py`, `skinny_candidates`). Two shapes take their weight
tiles through TMA (`SkinnyConfig.tma`, `weight_tma.py`), four and six steps
deep for the shared memory alone; only the sweep and the tables offer them
(not yet timed on a GPU; the one-token GEMV's TMA shapes lost to its pointer
loads on an H100).

Measured (H100, `benchmarks/results/h100/wave2/fp8_2026-12-06e/` and
`fp8_2026-12-06f/`): without split-K, at 4 tokens, us per launch in a
graph against cuBLAS with its quantisation kernel: qkv 16.1 / 16.4, o 13.4
/ 15.8, gate_up 50.7 / 50.0, down 38.4 / 31.6 (0.42-0.77 of the copy
bandwidth); a 4 x 32K decode step 3-4% faster than cuBLAS (8.87 against
9.20 ms). Split-K took that step to 8.06 ms against 8.78 without it (same
machine), and the four candidates (64 rows, split 1, 2, 4 or 8; the tuner
takes 8 for o, 4 for qkv and down, 1 for gate_up) to 8.06-8.08 against
8.20 with the seven before. Two-deep pipelines ran at 1.2-1.6x the time of
three-deep ones; sending down_proj to cuBLAS made the step slower (47.7 us
a launch inside it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.activation.silu_triton import silu_mul_rounded
from tokenspeed.kernels.arrival_counters import arrival_counters
from tokenspeed.kernels.autotune import LaunchTuner, TunedChoice
from tokenspeed.kernels.gemm.fp8_gemv_shapes import gpu_name_of, skinny_key, table_for
from tokenspeed.kernels.gemm.weight_tma import load_weight_tile, weight_descriptor
from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.quant.fp8 import GROUP_SIZE, BlockSize, scales_whole_rows
from tokenspeed.kernels.quant.fp8_cast import to_f16_saturated, widen_fp8
from tokenspeed.kernels.triton_launch import for_tensor

SKINNY_BLOCK_M = 16  # the tokens, padded to the smallest tile a tensor-core dot takes


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    """Launch shape of `_fp8_skinny_kernel`: BLOCK_N weight rows a program, `groups` x 128 of K a step."""

    block_n: int
    groups: int
    stages: int
    num_warps: int = 4
    split_k: int = 1  # programs sharing a row block's K; the last to finish sums their partials
    tma: bool = False  # weight tiles through the tensor memory accelerator where the weight fits (`weight_tma.py`)


def skinny_shapes() -> list[SkinnyConfig]:
    """The launch shapes worth timing (`benchmarks/fp8_skinny_stack.py` sweeps them; the GPU tests run each).

    The two-warp shapes are there for their instruction count: every warp converts the whole activation tile
    for its dot, so two warps over 64 rows issue 0.073 warp instructions per weight byte where four issue
    0.111, and two over 128 rows one K group deep 0.056 (`sass_loops skinny`, sm_90). The last is the H100
    table's gate/up launch (`fp8_gemv_shapes`; 42.4 against 43.6 us at two tokens in a decode graph)."""
    return [*skinny_candidates(()), SkinnyConfig(64, 2, 4), SkinnyConfig(64, 1, 6), SkinnyConfig(32, 2, 4),
            SkinnyConfig(32, 2, 4, split_k=8), SkinnyConfig(64, 1, 4, split_k=8), SkinnyConfig(128, 1, 4, 8, split_k=4),
            *(SkinnyConfig(64, 2, 3, 2, split_k=split) for split in (1, 4, 8)), SkinnyConfig(128, 1, 3, 2),
            # TMA weight tiles, deeper than the pointer loads' three steps (`weight_tma.py`; not yet timed on a GPU;
            # on an H100 the one-token GEMV's TMA shapes lost to its pointer loads)
            SkinnyConfig(64, 2, 4, split_k=4, tma=True), SkinnyConfig(64, 1, 6, split_k=4, tma=True)]


def skinny_candidates(key: tuple[Any, ...]) -> list[SkinnyConfig]:
    """The shapes `LaunchTuner` times per weight shape (the first is the default): 64 rows x 256 of K a step,
    three deep, K whole or split in 2, 4 or 8. In a decode step's graph on an H100 (4 and 16 tokens) every
    Llama-3.1-8B projection ran fastest, or within 3%, at one of these: o at 8 splits, down at 4, gate_up at
    1-2, qkv at 1; 32- and 16-row shapes and two-deep pipelines ran 1.2-4x slower
    (`benchmarks/results/h100/wave2/fp8_2026-12-06f/call3/skinny_stack.json`)."""
    return [SkinnyConfig(64, 2, 3, split_k=split) for split in (1, 2, 4, 8)]


# Tuned once per weight shape (the token count barely matters: the weights are the bytes).
_SKINNY_TUNER: LaunchTuner[SkinnyConfig] = LaunchTuner("gemm.fp8 skinny launch", skinny_candidates)


def tuned_skinny_shapes() -> dict[tuple[Any, ...], TunedChoice[SkinnyConfig]]:
    """The launch shape each weight shape got from the tuner (and the candidates' times), for benchmarks."""
    return _SKINNY_TUNER.chosen()


@cache  # called by every eager launch: the table lookup and its check run once per weight shape
def measured_skinny_shape(n: int, k: int, block_size: BlockSize, gpu_name: str) -> SkinnyConfig | None:
    """The launch shape measured for an `n x k` weight on this GPU model (`fp8_gemv_shapes.py`), None where no
    table has it. ValueError for a table's shape that is not one of `skinny_shapes` (the shapes the tests run)."""
    key = skinny_key(n, k, whole_rows=scales_whole_rows(block_size, k))
    measured = table_for(gpu_name).get(key)
    if measured is None:
        return None
    config = SkinnyConfig(**measured)
    if config not in skinny_shapes():
        raise ValueError(f"FP8 GEMV shapes table for {gpu_name or 'this device'}: {key} names {config}, "
                         "which is not one of the skinny GEMM's skinny_shapes")
    return config


@triton.jit
def _skinny_x(x_rows, k, offs_k, m_mask, norm_w_ptr, rstd, K: tl.constexpr, EVEN: tl.constexpr,
              F16_DOTS: tl.constexpr, HAS_NORM: tl.constexpr):
    """The tokens' activations of the K group at k, `[BLOCK_M, 128]`, as the dot takes them; RMS-normalised
    (`rstd` per token) and rounded as `rms_norm_reference` rounds them when HAS_NORM."""
    if EVEN:
        x = tl.load(x_rows + k + offs_k[None, :], mask=m_mask[:, None], other=0.0)
    else:
        x = tl.load(x_rows + k + offs_k[None, :], mask=m_mask[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
    if HAS_NORM:
        nw = tl.load(norm_w_ptr + k + offs_k, mask=(k + offs_k) < K, other=0.0).to(tl.float32)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
        x = (nw[None, :] * normed).to(x.dtype)
    if F16_DOTS:
        x = to_f16_saturated(x)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _skinny_dot(acc, x, w, scale_rows, k, n_mask, K: tl.constexpr, SCALE_BK: tl.constexpr, ROW_SCALE: tl.constexpr,
                EVEN: tl.constexpr, F16_DOTS: tl.constexpr):
    """acc + x @ w^T for one K group of 128 (fp32 accumulation), times the rows' scales of the group's K
    block unless the scales are per row (applied once at the end)."""
    if not ROW_SCALE:  # this group's product is scaled before it joins the sum
        acc_in = acc
        acc = tl.zeros(acc.shape, dtype=tl.float32)
    if F16_DOTS:
        acc = tl.dot(x, tl.trans(widen_fp8(w, tl.float16, False)), acc)
    else:
        acc = tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    if not ROW_SCALE:
        # A group wholly past K (the last step's second, say, where K is not a whole number of steps) has no
        # scale column: reading one would take whatever lies past the scales (a NaN times its zero product).
        in_k = n_mask if EVEN else n_mask & (k < K)
        acc = acc_in + acc * tl.load(scale_rows + k // SCALE_BK, mask=in_k, other=0.0)[None, :]
    return acc


@triton.jit
def _skinny_group(acc, acc_up, w, w_up, x_rows, scale_rows, up_scale_rows, k, offs_k, m_mask, n_mask, norm_w_ptr,
                  rstd, K: tl.constexpr, SCALE_BK: tl.constexpr, ROW_SCALE: tl.constexpr, EVEN: tl.constexpr,
                  F16_DOTS: tl.constexpr, SILU_MUL: tl.constexpr, HAS_NORM: tl.constexpr):
    """One K group of the gate (or only) rows and, with SILU_MUL, of the up rows: the activations are
    loaded (and normalised) and converted once for both."""
    x = _skinny_x(x_rows, k, offs_k, m_mask, norm_w_ptr, rstd, K, EVEN, F16_DOTS, HAS_NORM)
    acc = _skinny_dot(acc, x, w, scale_rows, k, n_mask, K, SCALE_BK, ROW_SCALE, EVEN, F16_DOTS)
    if SILU_MUL:
        acc_up = _skinny_dot(acc_up, x, w_up, up_scale_rows, k, n_mask, K, SCALE_BK, ROW_SCALE, EVEN, F16_DOTS)
    return acc, acc_up


@triton.jit
def _load_group(rows, up_rows, w_desc, row0, up_row0, k, offs_k, n_mask, K: tl.constexpr, EVEN: tl.constexpr,
                SILU_MUL: tl.constexpr, USE_TMA: tl.constexpr):
    """The weight tiles of the K group at k: the gate (or only) rows', and the up rows' with SILU_MUL."""
    w = load_weight_tile(rows, w_desc, row0, k, offs_k, n_mask, K, EVEN, USE_TMA)
    w_up = w
    if SILU_MUL:
        w_up = load_weight_tile(up_rows, w_desc, up_row0, k, offs_k, n_mask, K, EVEN, USE_TMA)
    return w, w_up


@triton.jit
def _fp8_skinny_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    ws_ptr,
    bias_ptr,
    norm_w_ptr,
    res_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
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
    ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP_K: tl.constexpr,
    STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    EVEN: tl.constexpr,
    F16_DOTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    BLOCK_K: tl.constexpr = GROUPS * GROUP_K
    PART_N: tl.constexpr = 2 * N if SILU_MUL else N  # a split's partials: the gate rows', then the up rows'
    pid_n = tl.program_id(0)
    k_lo = tl.program_id(1) * K_SPLIT  # this program's K range (a multiple of BLOCK_K wide, but the last)
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP_K)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = rows + N * stride_wn  # SILU_MUL: the up rows n + N of a [2N, K] weight
    row0 = pid_n * BLOCK_N
    # weights never depend on the previous kernel
    w_first, w_up_first = _load_group(rows, up_rows, w_desc, row0, N + row0, k_lo, offs_k, n_mask, K, EVEN,
                                      SILU_MUL, USE_TMA)
    scale_rows = ws_ptr + (offs_n // SCALE_BN) * stride_wsn  # each row's scales (row blocks may be narrow)
    up_scale_rows = ws_ptr + ((offs_n + N) // SCALE_BN) * stride_wsn
    # The epilogue's per-row terms too (as `fp8_gemv_triton`): no program ends on a dependent round trip.
    row_s = tl.full([BLOCK_N], 1.0, tl.float32)
    row_s_up = row_s
    if ROW_SCALE:
        row_s = tl.load(scale_rows, mask=n_mask, other=0.0)
        if SILU_MUL:
            row_s_up = tl.load(up_scale_rows, mask=n_mask, other=0.0)
    bias = tl.zeros([BLOCK_N], tl.float32)
    bias_up = bias
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SILU_MUL:
            bias_up = tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if USE_PDL:  # see kernels/pdl.py: wait for the previous kernel before reading x
        gdc_wait()
        gdc_launch_dependents()
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:  # each program recomputes its tokens' RMS over the whole row (cheaper than a norm kernel)
        squares = tl.zeros([BLOCK_M, GROUP_K], dtype=tl.float32)
        for k_sq in range(0, K, GROUP_K):
            in_row = m_mask[:, None] & ((k_sq + offs_k) < K)[None, :]
            xv = tl.load(x_rows + k_sq + offs_k[None, :], mask=in_row, other=0.0).to(tl.float32)
            squares += xv * xv
        rstd = tl.rsqrt(tl.sum(squares, 1) / K + eps)
    res = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HAS_RESIDUAL:  # requested now, used at the end: no round trip there
        res_rows = res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
        res = tl.load(res_rows + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = acc
    acc, acc_up = _skinny_group(acc, acc_up, w_first, w_up_first, x_rows, scale_rows, up_scale_rows, k_lo, offs_k,
                                m_mask, n_mask, norm_w_ptr, rstd, K, SCALE_BK, ROW_SCALE, EVEN, F16_DOTS, SILU_MUL,
                                HAS_NORM)
    for g in tl.static_range(1, GROUPS):  # the rest of the first step
        k = k_lo + g * GROUP_K
        w, w_up = _load_group(rows, up_rows, w_desc, row0, N + row0, k, offs_k, n_mask, K, EVEN, SILU_MUL, USE_TMA)
        acc, acc_up = _skinny_group(acc, acc_up, w, w_up, x_rows, scale_rows, up_scale_rows, k, offs_k, m_mask,
                                    n_mask, norm_w_ptr, rstd, K, SCALE_BK, ROW_SCALE, EVEN, F16_DOTS, SILU_MUL,
                                    HAS_NORM)
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):  # the rest, pipelined by the compiler
        for g in tl.static_range(GROUPS):
            k = k0 + g * GROUP_K
            w, w_up = _load_group(rows, up_rows, w_desc, row0, N + row0, k, offs_k, n_mask, K, EVEN, SILU_MUL,
                                  USE_TMA)
            acc, acc_up = _skinny_group(acc, acc_up, w, w_up, x_rows, scale_rows, up_scale_rows, k, offs_k, m_mask,
                                        n_mask, norm_w_ptr, rstd, K, SCALE_BK, ROW_SCALE, EVEN, F16_DOTS, SILU_MUL,
                                        HAS_NORM)
    if ROW_SCALE:
        acc *= row_s[None, :]
        if SILU_MUL:
            acc_up *= row_s_up[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    last = True
    if SPLIT_K > 1:  # store this split's partials; the row block's last program to arrive sums them all
        split_rows = (tl.program_id(1) * BLOCK_M + offs_m).to(tl.int64)
        parts = part_ptr + split_rows[:, None] * PART_N + offs_n[None, :]
        tl.store(parts, acc, mask=mask)
        if SILU_MUL:
            tl.store(parts + N, acc_up, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted (release)
        last = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        if last:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = acc
            for split in tl.static_range(SPLIT_K):  # in split order: the sum does not depend on arrival
                parts = part_ptr + ((split * BLOCK_M + offs_m).to(tl.int64))[:, None] * PART_N + offs_n[None, :]
                acc += tl.load(parts, mask=mask, other=0.0, cache_modifier=".cg")
                if SILU_MUL:
                    acc_up += tl.load(parts + N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch
    if last:
        out_dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += bias[None, :]
            acc_up += bias_up[None, :]
        if SILU_MUL:  # rounded as the unfused path: the GEMM's output, then the activation kernel's arithmetic
            y = silu_mul_rounded(acc.to(out_dtype).to(tl.float32), acc_up.to(out_dtype).to(tl.float32), out_dtype)
        else:
            y = acc.to(out_dtype)
        if HAS_RESIDUAL:  # the residual stream: round(round(x W^T) + residual), as the unfused add does
            y = (y.to(tl.float32) + res).to(out_dtype)
        dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(dst, y, mask=mask)


def split_plan(k: int, config: SkinnyConfig) -> tuple[int, int]:
    """(programs a row block's K is split over, K each covers): whole steps each, none empty."""
    block_k = config.groups * GROUP_SIZE
    steps = triton.cdiv(k, block_k)
    k_split = triton.cdiv(steps, min(config.split_k, steps)) * block_k
    return triton.cdiv(k, k_split), k_split


def fp8_skinny_gemm(
    x2: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    block_size: BlockSize,
    bias: torch.Tensor | None,
    config: SkinnyConfig | None = None,
    silu_mul: bool = False,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """out `[M, N]` = x2 `[M, K]` (M <= 16, contiguous along K) @ dequantised(weight)^T (+ bias), in the
    decode layer's fused forms as the one-token GEMV has them, each rounded as the unfused path:
    `norm_weight` RMS-normalises x first, `silu_mul` returns silu(gate) * up of a `[2N, K]`
    gate-then-up weight, `residual` `[M, N]` is added to the result.

    Arguments checked by the caller (`fp8_gemv_triton`); scales contiguous. The launch shape is the weight
    shape's (table or tuner); the fused form gives a program half its rows from the gate half and half from
    the up half, so it streams the same bytes a program as the plain GEMM at that shape.
    """
    m, k = x2.shape
    rows = weight.shape[0]
    n = rows // 2 if silu_mul else rows
    if m > SKINNY_BLOCK_M:
        raise ValueError(f"the skinny GEMM serves at most {SKINNY_BLOCK_M} tokens, got {m}")
    if config is None:
        config = measured_skinny_shape(rows, k, tuple(block_size), gpu_name_of(x2.device))
    if config is None:
        key = (rows, k, tuple(block_size), x2.dtype, bias is not None, silu_mul)
        run = partial(fp8_skinny_gemm, x2, weight, scales, out, block_size=block_size, bias=bias, silu_mul=silu_mul)
        config = _SKINNY_TUNER.choose(key, x2.device, lambda chosen: run(config=chosen))
    block_n = config.block_n // 2 if silu_mul else config.block_n
    block_k = config.groups * GROUP_SIZE
    n_blocks = triton.cdiv(n, block_n)
    splits, k_split = split_plan(k, config)
    counters = arrival_counters(x2.device, n_blocks) if splits > 1 else None
    if counters is None:  # one program per row block (also where no counters can be had: arrival_counters.py)
        splits, k_split = split_plan(k, dataclasses.replace(config, split_k=1))
    parts = out
    if splits > 1:
        parts = torch.empty(splits * SKINNY_BLOCK_M, rows, dtype=torch.float32, device=x2.device)
    w_desc = weight_descriptor(weight, block_n, GROUP_SIZE, config.tma)
    for_tensor(_fp8_skinny_kernel, x2)[(n_blocks, splits)](
        x2, weight, w_desc, scales, bias if bias is not None else out, norm_weight if norm_weight is not None else x2,
        residual if residual is not None else out, out, parts, counters if counters is not None else out,
        m, eps,
        x2.stride(0), weight.stride(0), scales.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0),
        N=n, K=k, SCALE_BN=block_size[0], SCALE_BK=block_size[1], ROW_SCALE=scales_whole_rows(block_size, k),
        BLOCK_M=SKINNY_BLOCK_M, BLOCK_N=block_n, GROUPS=config.groups, GROUP_K=GROUP_SIZE,
        STAGES=config.stages, SPLIT_K=splits, K_SPLIT=k_split, EVEN=n % block_n == 0 and k % block_k == 0,
        F16_DOTS=x2.dtype != torch.float32, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, USE_TMA=w_desc is not None,
        num_warps=config.num_warps, **pdl_launch_options(pdl_enabled(x2.device)),
    )  # fmt: skip
    return out
