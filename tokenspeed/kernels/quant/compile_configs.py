"""The FP8 Triton kernels at their serving configurations, for `tokenspeed.kernels.compile_check`.

Llama-3.1-8B's projections (K 4096 and 14336) with 128 x 128 weight blocks:
the activation quantiser, the tensor-core GEMM at both tile shapes
`fp8_gemm_triton.choose_tiles` picks, the one-token GEMV at every
launch shape of `fp8_gemv_triton.launch_shapes`, and the 2-16 token skinny
GEMM at every shape of `fp8_skinny_triton.skinny_shapes`, and in the decode
layer's fused forms at its tuner's candidates.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenspeed.kernels.compile_check import KernelConfig
from tokenspeed.kernels.gemm import fp8_gemm_triton, fp8_gemv_triton, fp8_skinny_triton
from tokenspeed.kernels.quant import quantize_triton
from tokenspeed.kernels.quant.fp8 import FP8_MAX, GROUP_SIZE, MIN_AMAX
from tokenspeed.kernels.triton_launch import next_power_of_2

FP8 = "fp8e4nv"


def _rope_pointers(fp8_cache: bool) -> dict[str, str]:
    cache = FP8 if fp8_cache else "bf16"
    return {"positions_ptr": "i64", "cos_ptr": "fp32", "sin_ptr": "fp32", "slot_ptr": "i64", "k_cache_ptr": cache,
            "v_cache_ptr": cache, "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}  # fmt: skip


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
    # SiLU-and-mul over [2N, K]), o and down (residual epilogue); every launch shape. And qkv with RoPE and
    # the K/V store in its epilogue (`kvstore/rope_store.py`), fp8 and bf16 caches, at its launch shape.
    forms = (("qkv", 6144, 4096, dict(HAS_NORM=True, HAS_RESIDUAL=False, SILU_MUL=False)),
             ("gate_up", 14336, 4096, dict(HAS_NORM=True, HAS_RESIDUAL=False, SILU_MUL=True)),
             ("o", 4096, 4096, dict(HAS_NORM=False, HAS_RESIDUAL=True, SILU_MUL=False)),
             ("down", 4096, 14336, dict(HAS_NORM=False, HAS_RESIDUAL=True, SILU_MUL=False)))
    rope = dict(ROPE_HALF=64, NUM_Q_HEADS=32, NUM_KV_HEADS=8, PAGE_SIZE=16, HAS_KV_SCALE=True, KV_SCALE_STRIDE=1)
    forms = tuple((form, n, k, fused | fp8_gemv_triton.NO_ROPE_STORE) for form, n, k, fused in forms)
    qkv_rope = [("qkv+rope fp8_cache", 6144, 4096, forms[0][3] | rope | dict(FP8_CACHE=True)),
                ("qkv+rope bf16_cache", 6144, 4096, forms[0][3] | rope | dict(FP8_CACHE=False, HAS_KV_SCALE=False))]
    for form, n, k, fused in forms + tuple(qkv_rope):
        shapes = fp8_gemv_triton.launch_shapes(k) if "rope" not in form else [fp8_gemv_triton.choose_config(k)]
        for cfg in shapes:
            constexprs = dict(N=n, K=k, SCALE_BN=128, SCALE_BK=128, ROW_SCALE=False, BLOCK_N=cfg.block_n)
            constexprs |= dict(GROUP_K=GROUP_SIZE, STAGES=cfg.stages, HAS_BIAS=False, USE_PDL=True) | fused
            constexprs |= dict(SCALE_COLS=next_power_of_2(k // 128), GROUPS=cfg.groups, F16_MATH=cfg.f16_math, EVEN=True)
            yield KernelConfig(
                f"gemm.fp8 triton_gemv {form} n={n} k={k} {cfg}",
                fp8_gemv_triton._fp8_gemv_kernel,
                constexprs,
                pointers={"w_ptr": FP8, "ws_ptr": "fp32"} | (_rope_pointers(fused["FP8_CACHE"]) if "rope" in form else {}),
                num_warps=cfg.num_warps,
            )
    # The skinny GEMM (2-16 tokens): plain at down_proj's shape, block and per-channel scales, every launch
    # shape; and in the decode layer's forms above at the shapes its tuner may pick.
    plain = dict(HAS_NORM=False, HAS_RESIDUAL=False, SILU_MUL=False)
    cases = [("plain", 4096, 14336, plain, cfg, row_scale) for cfg in fp8_skinny_triton.skinny_shapes()
             for row_scale in (False, True)]  # fmt: skip
    gemv_only = fp8_gemv_triton.NO_ROPE_STORE  # the one-token kernel's RoPE-and-store constexprs
    cases += [(form, n, k, {f: v for f, v in fused.items() if f not in gemv_only}, cfg, False)
              for form, n, k, fused in forms for cfg in fp8_skinny_triton.skinny_candidates(())]  # fmt: skip
    for form, n, k, fused, cfg, row_scale in cases:
        constexprs = dict(N=n, K=k, SCALE_BN=1 if row_scale else 128, SCALE_BK=k if row_scale else 128)
        constexprs |= dict(ROW_SCALE=row_scale, BLOCK_M=fp8_skinny_triton.SKINNY_BLOCK_M, BLOCK_N=cfg.block_n)
        splits, k_split = fp8_skinny_triton.split_plan(k, cfg)
        constexprs |= dict(GROUPS=cfg.groups, GROUP_K=GROUP_SIZE, STAGES=cfg.stages, EVEN=True, F16_DOTS=True)
        constexprs |= dict(SPLIT_K=splits, K_SPLIT=k_split, HAS_BIAS=False, USE_PDL=True) | fused
        yield KernelConfig(
            f"gemm.fp8 skinny {form} n={n} k={k} row_scale={row_scale} {cfg}",
            fp8_skinny_triton._fp8_skinny_kernel,
            constexprs,
            pointers={"w_ptr": FP8, "ws_ptr": "fp32", "part_ptr": "fp32", "count_ptr": "i32"},
            num_warps=cfg.num_warps,
        )
