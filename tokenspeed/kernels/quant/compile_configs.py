"""The FP8 Triton kernels at their serving configurations, for `tokenspeed.kernels.compile_check`.

Llama-3.1-8B's projections (K 4096 and 14336) with 128 x 128 weight blocks:
the activation quantiser, the tensor-core GEMM at both tile shapes
`fp8_gemm_triton.choose_tiles` picks, the one-token GEMV at every
launch shape of `fp8_gemv_triton.launch_shapes`, and the 2-16 token skinny
GEMM at every shape of `fp8_skinny_triton.skinny_shapes` (TMA shapes with their weight descriptor's
signature).
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenspeed.kernels.compile_check import KernelConfig
from tokenspeed.kernels.gemm import fp8_gemm_triton, fp8_gemv_triton, fp8_skinny_triton
from tokenspeed.kernels.quant import quantize_triton
from tokenspeed.kernels.quant.fp8 import FP8_MAX, GROUP_SIZE, MIN_AMAX
from tokenspeed.kernels.triton_launch import next_power_of_2

FP8 = "fp8e4nv"


def _tma_box(rows: int, cols: int) -> str:
    """The signature of a host TMA descriptor of fp8 weight tiles `[rows, cols]` (`gemm/weight_tma.py`)."""
    return f"tensordesc<{FP8}[{rows}, {cols}]>"


def fp8_compile_configs() -> Iterator[KernelConfig]:
    yield KernelConfig(
        "quant.per_token_group",
        quantize_triton._per_token_group_kernel,
        dict(GROUP=GROUP_SIZE, GROUPS=16, MIN_SCALED_AMAX=MIN_AMAX, MAX_FP8=FP8_MAX),
        pointers={"q_ptr": FP8, "scale_ptr": "fp32"},
    )
    for m in (256, 4096):
        tiles = fp8_gemm_triton.choose_tiles(m)
        yield KernelConfig(
            f"gemm.fp8 triton m={m}",
            fp8_gemm_triton._fp8_gemm_kernel,
            dict(SCALE_BN=128, SCALE_BK=128, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=GROUP_SIZE)
            | dict(GROUP_M=tiles.group_m, HAS_BIAS=False, ONE_B_SCALE=True),
            pointers={"a_ptr": FP8, "b_ptr": FP8, "a_scale_ptr": "fp32", "b_scale_ptr": "fp32"},
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            multiple_of_16=("K",),
        )
    # The decode layer's forms at Llama-3.1-8B shapes: qkv (RMSNorm prologue), gate/up (RMSNorm and
    # SiLU-and-mul over [2N, K]), o and down (residual epilogue); every launch shape.
    forms = (("qkv", 6144, 4096, dict(HAS_NORM=True, HAS_RESIDUAL=False, SILU_MUL=False)),
             ("gate_up", 14336, 4096, dict(HAS_NORM=True, HAS_RESIDUAL=False, SILU_MUL=True)),
             ("o", 4096, 4096, dict(HAS_NORM=False, HAS_RESIDUAL=True, SILU_MUL=False)),
             ("down", 4096, 14336, dict(HAS_NORM=False, HAS_RESIDUAL=True, SILU_MUL=False)))
    for form, n, k, fused in forms:
        for cfg in fp8_gemv_triton.launch_shapes(k):
            constexprs = dict(N=n, K=k, SCALE_BN=128, SCALE_BK=128, ROW_SCALE=False, BLOCK_N=cfg.block_n)
            constexprs |= dict(GROUP_K=GROUP_SIZE, STAGES=cfg.stages, HAS_BIAS=False, USE_PDL=True) | fused
            constexprs |= dict(SCALE_COLS=next_power_of_2(k // 128), GROUPS=cfg.groups, F16_MATH=cfg.f16_math, EVEN=True)
            constexprs |= dict(USE_TMA=cfg.tma) | ({} if cfg.tma else dict(w_desc=None))
            yield KernelConfig(
                f"gemm.fp8 triton_gemv {form} n={n} k={k} {cfg}",
                fp8_gemv_triton._fp8_gemv_kernel,
                constexprs,
                pointers={"w_ptr": FP8, "ws_ptr": "fp32"}
                | ({"w_desc": _tma_box(cfg.block_n, cfg.groups * GROUP_SIZE)} if cfg.tma else {}),
                num_warps=cfg.num_warps,
            )
    # The skinny GEMM (2-16 tokens) at down_proj's shape (the others differ only in N and K), block and
    # per-channel scales; every launch shape.
    n, k = 4096, 14336
    for cfg in fp8_skinny_triton.skinny_shapes():
        for row_scale in (False, True):
            constexprs = dict(N=n, K=k, SCALE_BN=1 if row_scale else 128, SCALE_BK=k if row_scale else 128)
            constexprs |= dict(ROW_SCALE=row_scale, BLOCK_M=fp8_skinny_triton.SKINNY_BLOCK_M, BLOCK_N=cfg.block_n)
            splits, k_split = fp8_skinny_triton.split_plan(k, cfg)
            constexprs |= dict(GROUPS=cfg.groups, GROUP_K=GROUP_SIZE, STAGES=cfg.stages, EVEN=True, F16_DOTS=True)
            constexprs |= dict(SPLIT_K=splits, K_SPLIT=k_split, HAS_BIAS=False, USE_PDL=True)
            constexprs |= dict(USE_TMA=cfg.tma) | ({} if cfg.tma else dict(w_desc=None))
            yield KernelConfig(
                f"gemm.fp8 skinny n={n} k={k} row_scale={row_scale} {cfg}",
                fp8_skinny_triton._fp8_skinny_kernel,
                constexprs,
                pointers={"w_ptr": FP8, "ws_ptr": "fp32", "part_ptr": "fp32", "count_ptr": "i32"}
                | ({"w_desc": _tma_box(cfg.block_n, GROUP_SIZE)} if cfg.tma else {}),
                num_warps=cfg.num_warps,
            )
