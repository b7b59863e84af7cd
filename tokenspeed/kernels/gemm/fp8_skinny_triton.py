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

No fused forms (RMSNorm prologue, SiLU-and-mul, residual epilogue), unlike
the one-token GEMV: they were built (c596b13, 1e5f8f1) and made Llama-3.1-8B
FP8 28-31% slower at 4 and 16 rows on an H100
(`benchmarks/results/h100/wave2/skinny_fused_2026-12-08/`; likely, not
profiled, because every program and K split re-read its tokens' activations
for the RMS), so 2-16 row steps keep the norm and activation kernels.

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
def _skinny_group(acc, w, x_rows, scale_rows, k, offs_k, m_mask, n_mask, K: tl.constexpr, SCALE_BK: tl.constexpr,
                  ROW_SCALE: tl.constexpr, EVEN: tl.constexpr, F16_DOTS: tl.constexpr):
    """acc + x[:, k:k+128] @ w^T for one K group of 128 (fp32 accumulation), times the rows' scales of the
    group's K block unless the scales are per row (applied once at the end)."""
    if EVEN:
        x = tl.load(x_rows + k + offs_k[None, :], mask=m_mask[:, None], other=0.0)
    else:
        x = tl.load(x_rows + k + offs_k[None, :], mask=m_mask[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
    if not ROW_SCALE:  # this group's product is scaled before it joins the sum
        acc_in = acc
        acc = tl.zeros(acc.shape, dtype=tl.float32)
    if F16_DOTS:
        acc = tl.dot(to_f16_saturated(x), tl.trans(widen_fp8(w, tl.float16, False)), acc)
    else:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    if not ROW_SCALE:
        # A group wholly past K (the last step's second, say, where K is not a whole number of steps) has no
        # scale column: reading one would take whatever lies past the scales (a NaN times its zero product).
        in_k = n_mask if EVEN else n_mask & (k < K)
        acc = acc_in + acc * tl.load(scale_rows + k // SCALE_BK, mask=in_k, other=0.0)[None, :]
    return acc


@triton.jit
def _fp8_skinny_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    ws_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    stride_xm,
    stride_wn,
    stride_wsn,
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
    USE_PDL: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    BLOCK_K: tl.constexpr = GROUPS * GROUP_K
    pid_n = tl.program_id(0)
    k_lo = tl.program_id(1) * K_SPLIT  # this program's K range (a multiple of BLOCK_K wide, but the last)
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP_K)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    row0 = pid_n * BLOCK_N
    # weights never depend on the previous kernel
    w_first = load_weight_tile(rows, w_desc, row0, k_lo, offs_k, n_mask, K, EVEN, USE_TMA)
    scale_rows = ws_ptr + (offs_n // SCALE_BN) * stride_wsn  # each row's scales (row blocks may be narrow)
    # The epilogue's per-row terms too (as `fp8_gemv_triton`): no program ends on a dependent round trip.
    row_s = tl.full([BLOCK_N], 1.0, tl.float32)
    if ROW_SCALE:
        row_s = tl.load(scale_rows, mask=n_mask, other=0.0)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if USE_PDL:  # see kernels/pdl.py: wait for the previous kernel before reading x
        gdc_wait()
        gdc_launch_dependents()
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _skinny_group(acc, w_first, x_rows, scale_rows, k_lo, offs_k, m_mask, n_mask, K, SCALE_BK, ROW_SCALE,
                        EVEN, F16_DOTS)
    for g in tl.static_range(1, GROUPS):  # the rest of the first step
        k = k_lo + g * GROUP_K
        w = load_weight_tile(rows, w_desc, row0, k, offs_k, n_mask, K, EVEN, USE_TMA)
        acc = _skinny_group(acc, w, x_rows, scale_rows, k, offs_k, m_mask, n_mask, K, SCALE_BK, ROW_SCALE, EVEN,
                            F16_DOTS)
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):  # the rest, pipelined by the compiler
        for g in tl.static_range(GROUPS):
            k = k0 + g * GROUP_K
            w = load_weight_tile(rows, w_desc, row0, k, offs_k, n_mask, K, EVEN, USE_TMA)
            acc = _skinny_group(acc, w, x_rows, scale_rows, k, offs_k, m_mask, n_mask, K, SCALE_BK, ROW_SCALE, EVEN,
                                F16_DOTS)
    if ROW_SCALE:
        acc *= row_s[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    last = True
    if SPLIT_K > 1:  # store this split's partial; the row block's last program to arrive sums them all
        split_rows = (tl.program_id(1) * BLOCK_M + offs_m).to(tl.int64)
        tl.store(part_ptr + split_rows[:, None] * N + offs_n[None, :], acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted (release)
        last = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        if last:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):  # in split order: the sum does not depend on arrival
                rows_s = (split * BLOCK_M + offs_m).to(tl.int64)
                acc += tl.load(part_ptr + rows_s[:, None] * N + offs_n[None, :], mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch
    if last:
        if HAS_BIAS:
            acc += bias[None, :]
        dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
) -> torch.Tensor:
    """out `[M, N]` = x2 `[M, K]` (M <= 16, contiguous along K) @ dequantised(weight)^T (+ bias).

    Arguments checked by the caller (`fp8_gemv_triton`); scales contiguous. The launch shape is the weight
    shape's (table or tuner).
    """
    m, k = x2.shape
    n = weight.shape[0]
    if m > SKINNY_BLOCK_M:
        raise ValueError(f"the skinny GEMM serves at most {SKINNY_BLOCK_M} tokens, got {m}")
    if config is None:
        config = measured_skinny_shape(n, k, tuple(block_size), gpu_name_of(x2.device))
    if config is None:
        key = (n, k, tuple(block_size), x2.dtype, bias is not None)
        run = partial(fp8_skinny_gemm, x2, weight, scales, out, block_size=block_size, bias=bias)
        config = _SKINNY_TUNER.choose(key, x2.device, lambda chosen: run(config=chosen))
    block_k = config.groups * GROUP_SIZE
    n_blocks = triton.cdiv(n, config.block_n)
    splits, k_split = split_plan(k, config)
    counters = arrival_counters(x2.device, n_blocks) if splits > 1 else None
    if counters is None:  # one program per row block (also where no counters can be had: arrival_counters.py)
        splits, k_split = split_plan(k, dataclasses.replace(config, split_k=1))
    parts = torch.empty(splits * SKINNY_BLOCK_M, n, dtype=torch.float32, device=x2.device) if splits > 1 else out
    w_desc = weight_descriptor(weight, config.block_n, GROUP_SIZE, config.tma)
    for_tensor(_fp8_skinny_kernel, x2)[(n_blocks, splits)](
        x2, weight, w_desc, scales, bias if bias is not None else out, out, parts,
        counters if counters is not None else out, m,
        x2.stride(0), weight.stride(0), scales.stride(0), out.stride(0),
        N=n, K=k, SCALE_BN=block_size[0], SCALE_BK=block_size[1], ROW_SCALE=scales_whole_rows(block_size, k),
        BLOCK_M=SKINNY_BLOCK_M, BLOCK_N=config.block_n, GROUPS=config.groups, GROUP_K=GROUP_SIZE,
        STAGES=config.stages, SPLIT_K=splits, K_SPLIT=k_split, EVEN=n % config.block_n == 0 and k % block_k == 0,
        F16_DOTS=x2.dtype != torch.float32, HAS_BIAS=bias is not None, USE_TMA=w_desc is not None,
        num_warps=config.num_warps, **pdl_launch_options(pdl_enabled(x2.device)),
    )  # fmt: skip
    return out
