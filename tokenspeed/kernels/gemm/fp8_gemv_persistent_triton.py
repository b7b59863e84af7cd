"""One-token FP8 GEMV with persistent programs: x prepared once a program, weight tiles streamed through a pipeline.

Why: the per-tile kernel (`fp8_gemv_triton.py`) gives every program a few
rows; each program then waits for its first weights, makes a pass over x
(its RMS and peak), loads its row block's scales, and only then asks for
its next weights. On an H200 that kernel reads at 0.59-0.77 of the copy
bandwidth inside a decode step's graph (bf16's GEMV at 0.97,
`benchmarks/results/h200/fp8/2026-12-06b/`): the SMs' memory queues run
dry during each program's chain of dependent L2 round trips. Here a grid of
`programs_per_sm` programs an SM walks the row tiles (tile = program id +
i * grid); the compiler pipelines the tiles' weight loads through shared
memory (`STAGES`), so the next tiles are in flight while one is reduced,
and the x pass runs once a program, not once a tile.

Rows up to `MAX_K` long (the whole row is one tile step: K = 4096 for
Llama-3.1-8B's qkv, o and gate_up); longer rows (down_proj) and fp32
activations take the per-tile kernel.

Arithmetic (fp16 lanes, as the per-tile kernel's default loop): x is
normalised (HAS_NORM, rounded as `rms_norm_reference` rounds it), scaled
by a power of two `f` from its peak and held in fp16; a tile's products
w * x are summed in fp16 in runs of LANE_RUN consecutive K (one fp16
rounding a product, below bf16's output rounding), the runs in fp32, and
each K group's sum times its block scale, so x needs no per-row-block
scaling and f depends on x only: |w| <= 448 and |x * f| <= bound keep a
run under `_LANE_LIMIT`. Per-channel scales (`ROW_SCALE`) multiply the
finished row sums. Epilogues as the per-tile kernel's (bias, SiLU-and-mul
of gate rows n and up rows n + N, residual), rounded step by step like the
unfused path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed.kernels.gemm.gemv_triton import load_rows
from tokenspeed.kernels.pdl import pdl_enabled, pdl_launch_options
from tokenspeed.kernels.quant.fp8 import GROUP_SIZE, BlockSize
from tokenspeed.kernels.triton_launch import for_tensor, next_power_of_2, sm_count_of

MAX_K = 8192
_LANE_LIMIT = tl.constexpr(16384.0)  # the largest magnitude a run of LANE_RUN fp16 products may reach
LANE_RUN = tl.constexpr(16)


@dataclass(frozen=True, slots=True)
class Fp8PersistentConfig:
    """Launch shape of `_fp8_gemv_persistent_kernel`: BLOCK_N rows a tile, `programs_per_sm` programs an SM."""

    block_n: int
    programs_per_sm: int
    num_warps: int
    stages: int


def persistent_shapes() -> list[Fp8PersistentConfig]:
    """The launch shapes worth timing (`benchmarks/gemv_stack.py` sweeps them; the tests run each).
    Tiles of 4-8 rows x K (16-32 KB at K = 4096), two or three in flight a program."""
    return [
        Fp8PersistentConfig(block_n=4, programs_per_sm=4, num_warps=4, stages=3),
        Fp8PersistentConfig(block_n=4, programs_per_sm=2, num_warps=8, stages=4),
        Fp8PersistentConfig(block_n=8, programs_per_sm=2, num_warps=8, stages=3),
        Fp8PersistentConfig(block_n=2, programs_per_sm=4, num_warps=4, stages=4),
        Fp8PersistentConfig(block_n=4, programs_per_sm=3, num_warps=4, stages=4),
    ]


def fits_persistent(k: int, x_dtype: torch.dtype) -> bool:
    """Whether the persistent kernel serves rows of `k` for activations of `x_dtype`."""
    return k <= MAX_K and x_dtype in (torch.bfloat16, torch.float16)


@triton.jit
def round_like_unfused(acc, acc_up, x_ptr, SILU_MUL: tl.constexpr):
    """The GEMM output (and with SILU_MUL, silu(gate) * up) rounded step by step to the activation dtype,
    as the unfused path rounds it (GEMM output, activation, product), back in fp32 for the residual add."""
    act_dtype = x_ptr.dtype.element_ty
    acc = acc.to(act_dtype).to(tl.float32)
    if SILU_MUL:
        up = acc_up.to(act_dtype).to(tl.float32)
        gate = (acc / (1.0 + tl.exp(-acc))).to(act_dtype).to(tl.float32)
        acc = (gate * up).to(act_dtype).to(tl.float32)
    return acc


@triton.jit
def _prepare_x(x_row, offs_k, k_ok, norm_w_ptr, eps, K: tl.constexpr, HAS_NORM: tl.constexpr):
    """x as the GEMM sees it (normalised like `rms_norm_reference` when HAS_NORM), times the power of
    two f that keeps every run of fp16 products under _LANE_LIMIT, in fp16; and 1 / f."""
    x = tl.load(x_row + offs_k, mask=k_ok, other=0.0)
    if HAS_NORM:
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
        nw = tl.load(norm_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        x = (nw * (xf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
    xf = x.to(tl.float32)
    bound: tl.constexpr = _LANE_LIMIT / (448.0 * LANE_RUN)
    f = tl.exp2(tl.minimum(tl.floor(tl.log2(bound / tl.maximum(tl.max(tl.abs(xf), 0), 1e-30))), 100.0))
    return (xf * f).to(tl.float16), 1.0 / f


@triton.jit
def _tile_sums(w, xs, scale_row, offs_g, K: tl.constexpr, SCALE_BK: tl.constexpr, BLOCK_N: tl.constexpr,
               KP: tl.constexpr, ROW_SCALE: tl.constexpr):
    """Row sums of a `[BLOCK_N, KP]` fp8 tile times x: fp16 runs, fp32 groups, each group times its scale."""
    prod = w.to(tl.float16) * xs[None, :]
    runs = tl.sum(tl.reshape(prod, [BLOCK_N, KP // LANE_RUN, LANE_RUN]), 2, dtype=tl.float16).to(tl.float32)
    if ROW_SCALE:
        return tl.sum(runs, 1)
    groups = tl.sum(tl.reshape(runs, [BLOCK_N, KP // 128, 128 // LANE_RUN]), 2)
    group_start = offs_g * 128
    scales = tl.load(scale_row + group_start // SCALE_BK, mask=group_start < K, other=0.0)
    return tl.sum(groups * scales[None, :], 1)


@triton.jit
def _fp8_gemv_persistent_kernel(
    x_ptr,
    w_ptr,
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
    KP: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    TILES: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    token = tl.program_id(1)
    offs_k = tl.arange(0, KP)
    k_ok = offs_k < K
    offs_g = tl.arange(0, KP // 128)
    x_row = x_ptr + token.to(tl.int64) * stride_xm
    xs = tl.zeros([KP], dtype=tl.float16)
    inv_f = tl.full([], 1.0, tl.float32)
    for tile in tl.range(pid, TILES, grid, num_stages=STAGES):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        w = load_rows(rows, offs_k, n_mask, K, EVEN)
        if SILU_MUL:
            wu = load_rows(rows + N * stride_wn, offs_k, n_mask, K, EVEN)
        # x once a program, inside the first iteration, so that the compiler's prologue (the first
        # tiles' weights, which never depend on the previous kernel) is issued before the PDL wait.
        if tile == pid:
            if USE_PDL:  # see kernels/pdl.py: wait for the previous kernel before reading x
                gdc_wait()
                gdc_launch_dependents()
            xs, inv_f = _prepare_x(x_row, offs_k, k_ok, norm_w_ptr, eps, K, HAS_NORM)
        scale_row = ws_ptr + ((tile * BLOCK_N) // SCALE_BN) * stride_wsn
        acc = _tile_sums(w, xs, scale_row, offs_g, K, SCALE_BK, BLOCK_N, KP, ROW_SCALE) * inv_f
        if ROW_SCALE:
            acc *= tl.load(ws_ptr + (offs_n // SCALE_BN) * stride_wsn, mask=n_mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        up = acc
        if SILU_MUL:
            up_scale_row = ws_ptr + ((tile * BLOCK_N + N) // SCALE_BN) * stride_wsn
            up = _tile_sums(wu, xs, up_scale_row, offs_g, K, SCALE_BK, BLOCK_N, KP, ROW_SCALE) * inv_f
            if ROW_SCALE:
                up *= tl.load(ws_ptr + ((offs_n + N) // SCALE_BN) * stride_wsn, mask=n_mask, other=0.0)
            if HAS_BIAS:
                up += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SILU_MUL or HAS_RESIDUAL:
            acc = round_like_unfused(acc, up, x_ptr, SILU_MUL)
        if HAS_RESIDUAL:
            acc += tl.load(res_ptr + token.to(tl.int64) * stride_rm + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def fp8_gemv_persistent(
    x2: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    config: Fp8PersistentConfig,
    *,
    block_size: BlockSize,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    silu_mul: bool,
) -> None:
    """out `[m, N]` = the one-token GEMV of each row of x2 `[m, K]` (arguments checked by `fp8_gemv_triton`)."""
    m, k = x2.shape
    n = out.shape[1]
    row_scale = block_size[1] >= k
    block_n = config.block_n
    while not row_scale and block_size[0] % block_n:  # a tile's rows lie in one row block
        block_n //= 2
    if not row_scale and block_size[1] % GROUP_SIZE:
        raise ValueError(f"block scales along K must span whole groups of {GROUP_SIZE}: {block_size}")
    args = (
        x2, weight, scales, bias if bias is not None else out,
        norm_weight if norm_weight is not None else x2, residual if residual is not None else out, out, eps,
        x2.stride(0), weight.stride(0), scales.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0),
    )  # fmt: skip
    constexprs = dict(
        N=n, K=k, KP=max(next_power_of_2(k), GROUP_SIZE), SCALE_BN=block_size[0], SCALE_BK=block_size[1],
        ROW_SCALE=row_scale, BLOCK_N=block_n, STAGES=config.stages, EVEN=n % block_n == 0 and k == next_power_of_2(k),
        HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        SILU_MUL=silu_mul, num_warps=config.num_warps, **pdl_launch_options(pdl_enabled(x2.device)),
    )  # fmt: skip
    kernel = for_tensor(_fp8_gemv_persistent_kernel, x2)
    per_sm = config.programs_per_sm
    if x2.device.type == "cuda":  # never more programs than fit at once: a second wave would be the tail
        per_sm = min(per_sm, _resident_programs(kernel, args, constexprs, x2.device))
    grid = min(triton.cdiv(n, block_n), per_sm * sm_count_of(x2.device))
    kernel[(grid, m)](*args, **constexprs)


_RESIDENT: dict[tuple, int] = {}


def _resident_programs(kernel: triton.JITFunction, args: tuple, constexprs: dict, device: torch.device) -> int:
    """How many programs of this compiled kernel an SM holds at once (registers, shared memory, threads)."""
    key = (device.index, args[0].dtype, tuple(sorted((k, str(v)) for k, v in constexprs.items())))
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=(1,), **constexprs)
        compiled._init_handles()
        props = torch.cuda.get_device_properties(device)
        threads = 32 * compiled.metadata.num_warps
        regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256  # allocated per warp in units of 256
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * compiled.metadata.num_warps)
        smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
        by_smem = smem // (compiled.metadata.shared + 1024) if compiled.metadata.shared else 32
        by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
        _RESIDENT[key] = max(1, min(by_regs, by_smem, by_threads, 32))
    return _RESIDENT[key]

