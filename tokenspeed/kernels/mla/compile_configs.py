"""The MLA kernels at their serving configurations, for `tokenspeed.kernels.compile_check`.

DeepSeek-V3 dims (latent 512 + rope 64, pages of 64, bf16 and fp8 caches), at exactly the
tiles and launch sizes the launchers choose (`decode_plan`), so the sm_90
compile-and-spill check covers what the GPU will run.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenspeed.kernels.compile_check import KernelConfig
from tokenspeed.kernels.mla import decode_plan, decode_triton, extend_triton, write_triton

_TABLES = {"page_table_ptr": "i32", "seq_lens_ptr": "i32", "query_start_ptr": "i32"}
_PARTIALS = {"part_out_ptr": "fp32", "part_lse_ptr": "fp32"}
_DIMS = dict(KV_LORA=512, ROPE=64, PAGE_SIZE=64, BLOCK_L=512, BLOCK_R=64, IEEE=False)
# An fp8 e4m3 latent cache with its scale; bf16 caches pass the cache for the unused scale.
_FP8 = {"cache_ptr": "fp8e4nv", "kv_scale_ptr": "fp32"}


def mla_compile_configs() -> Iterator[KernelConfig]:
    # (heads, q_len, split kernel, positions per split): short splits take the online softmax, long the anchored
    for heads, q_len, split, split_tokens, fp8 in (
        (16, 1, True, 64, False),
        (16, 1, True, 4096, False),
        (16, 2, True, 4096, False),
        (16, 4, False, 4096, False),
        (128, 1, True, 4096, False),
        (16, 1, True, 4096, True),
        (128, 1, True, 4096, True),
    ):
        fold = decode_plan.choose_fold(heads, q_len)
        per_block, blocks = decode_plan.head_tiling(heads, fold)
        block_m = decode_plan.block_m_of(heads, fold)
        launch = decode_plan.default_launch(block_m, torch.bfloat16, split_tokens, fp8_cache=fp8)
        dtype = torch.float16 if fp8 else torch.bfloat16  # the dots' dtype (fp16 for fp8 caches)
        yield KernelConfig(
            f"mla.decode heads={heads} q_len={q_len} split={split} split_tokens={split_tokens} fp8={fp8}",
            decode_triton._mla_decode_kernel,
            dict(NUM_HEADS=heads, FOLD=fold, HEADS_PER_BLOCK=per_block, HEAD_BLOCKS=blocks)
            | dict(SPLIT=split, BLOCK_M=block_m, BLOCK_N=launch.block_n)
            | dict(ANCHORED=launch.anchored, HEADROOM=decode_plan.anchor_headroom(dtype))
            | dict(HAS_SCALE=fp8, F16_DOTS=fp8)
            | _DIMS,
            pointers=_TABLES | _PARTIALS | (_FP8 if fp8 else {}),
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
            # The anchored 16/32-row tiles spill a little (each warp holds the whole 16 x 576 query as its
            # MMA operand); on long splits they measured 1.25x faster than the spill-free online launch.
            # fp8 64-row tiles widen the cache tile in registers and spill ~170 B (decode_plan.default_launch).
            spill_allowance=512 if launch.anchored or (fp8 and block_m == 64) else 0,
        )
    yield KernelConfig(
        "mla.decode merge",
        decode_triton._mla_merge_kernel,
        dict(NUM_HEADS=16, KV_LORA=512, BLOCK_S=128, BLOCK_D=64),
        pointers=_PARTIALS,
    )
    for heads, fp8 in ((128, False), (16, False), (128, True)):
        tiles = extend_triton.extend_tiles(heads, torch.bfloat16, fp8_cache=fp8)
        yield KernelConfig(
            f"mla.extend heads={heads} fp8={fp8}",
            extend_triton._mla_extend_kernel,
            dict(NUM_HEADS=heads, TOKENS=tiles.tokens, HEADS_PER_BLOCK=tiles.heads_per_block)
            | dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, HAS_SCALE=fp8, F16_DOTS=fp8)
            | _DIMS,
            pointers=_TABLES | (_FP8 if fp8 else {}),
            spill_allowance=320 if fp8 else 0,  # see extend_triton.extend_tiles
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    for fp8 in (False, True):
        yield KernelConfig(
            f"mla.write fp8={fp8}",
            write_triton._mla_write_kernel,
            dict(WIDTH=576, PAGE_SIZE=64, BLOCK=1024, FP8_CACHE=fp8, HAS_SCALE=fp8),
            pointers={"slot_ptr": "i64", "scale_ptr": "fp32"} | ({"cache_ptr": "fp8e4nv"} if fp8 else {}),
        )
