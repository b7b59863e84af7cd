"""The MoE Triton kernels at their serving configurations, for `tokenspeed.kernels.compile_check`.

Moonlight (hidden 2048, intermediate 1408, 64 experts, top-6) and
Qwen3-30B-A3B (2048, 768, 128 experts, top-8) in bf16 (Qwen3-30B-A3B
also with FP8 experts, in the operand precision each tile size uses),
at every tile configuration `experts_triton.tile_config` can choose and the alignment
kernel at the batch sizes it serves, plus the router of each (and
DeepSeek-V3's grouped one) with its logits, and the k-sum of the pairs, so the sm_90 compile-and-spill check
covers what the GPU will run.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenspeed.kernels.compile_check import KernelConfig
from tokenspeed.kernels.moe import align_triton, experts_triton, router_logits_triton, routing_triton
from tokenspeed.kernels.triton_launch import next_power_of_2

SHAPES = {"moonlight": (2048, 1408, 64, 6), "qwen3_30b_a3b": (2048, 768, 128, 8)}
# name: (experts, top_k, sigmoid, groups, kept groups, top-2 group scores, routed scaling factor)
ROUTERS = {
    "qwen3_30b_a3b": (128, 8, False, 1, 1, False, 1.0),
    "moonlight": (64, 6, True, 1, 1, True, 2.446),
    "deepseek_v3": (256, 8, True, 8, 4, True, 2.5),
}
_POINTERS = {"pair_ids_ptr": "i32", "block_expert_ptr": "i32", "weights_ptr": "fp32"} | {
    name: "fp32" for name in ("x_scale_ptr", "act_scale_ptr", "w_scale_ptr")
}
_BF16 = dict(W_FP8=False, A_FP8=False, F16_DOTS=False, SCALE_BN=1, SCALE_BK=1, GROUP_K=128)
# FP8 experts (Qwen3-30B-A3B-FP8's 128 x 128 blocks): weights widened at decode, fp8 tensor cores above.
_FP8_MODES = {
    experts_triton.DECODE_TILES: dict(W_FP8=True, A_FP8=False, F16_DOTS=True, SCALE_BN=128, SCALE_BK=128)
    | dict(GROUP_K=128),
    experts_triton.MEDIUM_TILES: dict(W_FP8=True, A_FP8=True, F16_DOTS=False, SCALE_BN=128, SCALE_BK=128)
    | dict(GROUP_K=128),
    experts_triton.PREFILL_TILES: dict(W_FP8=True, A_FP8=True, F16_DOTS=False, SCALE_BN=128, SCALE_BK=128)
    | dict(GROUP_K=128),
}


def moe_compile_configs() -> Iterator[KernelConfig]:
    for name, (experts, top_k, sigmoid, groups, kept, top2, scaling) in ROUTERS.items():
        yield KernelConfig(
            f"moe.route {name}",
            routing_triton._route_kernel,
            dict(NUM_EXPERTS=experts, TOP_K=top_k, SIGMOID=sigmoid, HAS_BIAS=sigmoid, RENORMALIZE=True)
            | dict(NUM_GROUPS=groups, TOPK_GROUPS=kept, GROUP_TOP2=top2, BLOCK_E=next_power_of_2(experts))
            | dict(
                BLOCK_G=next_power_of_2(groups), BLOCK_K=next_power_of_2(top_k), SCALING=scaling, EPS=1e-20
            ),
            pointers={"weights_ptr": "fp32", "ids_ptr": "i32", "bias_ptr": "fp32"},
            num_warps=routing_triton.num_warps_for(experts),
        )
        hidden = 7168 if name == "deepseek_v3" else 2048
        yield KernelConfig(
            f"moe.router_logits {name}",
            router_logits_triton._router_logits_kernel,
            dict(E=experts, H=hidden, BLOCK_E=router_logits_triton.BLOCK_E, BLOCK_K=router_logits_triton.BLOCK_K),
            pointers={"w_ptr": "fp32", "out_ptr": "fp32"},
        )
    for name, (hidden, inter, experts, top_k) in SHAPES.items():
        yield KernelConfig(
            f"moe.sum_pairs {name}",
            experts_triton._sum_pairs_kernel,
            dict(H=hidden, TOP_K=top_k, BLOCK_H=experts_triton.SUM_BLOCK_H),
        )
        for tokens in (1, 64, align_triton.ALIGN_TRITON_MAX_PAIRS // top_k):
            block_e = next_power_of_2(experts)
            block_p, block_b = align_triton.pairs_block(tokens * top_k), align_triton.blocks_per_pass(block_e)
            yield KernelConfig(
                f"moe.align {name} tokens={tokens}",
                align_triton._align_kernel,
                dict(NUM_EXPERTS=experts, BLOCK_M=16, BLOCK_P=block_p, BLOCK_E=block_e, BLOCK_B=block_b),
                pointee="i32",
                num_warps=align_triton.NUM_WARPS,
            )
        for tiles in (experts_triton.DECODE_TILES, experts_triton.MEDIUM_TILES, experts_triton.PREFILL_TILES):
            variants = {"": _BF16} | ({"fp8 ": _FP8_MODES[tiles]} if name == "qwen3_30b_a3b" else {})
            for label, flags in variants.items():
                common = dict(BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, IEEE=False)
                common |= flags
                weights = {"w_ptr": "fp8e4nv"} if flags["W_FP8"] else {}
                inputs = {"x_ptr": "fp8e4nv", "act_ptr": "fp8e4nv"} if flags["A_FP8"] else {}
                yield KernelConfig(
                    f"moe.experts {label}gate_up {name} block_m={tiles.block_m}",
                    experts_triton._moe_gate_up_kernel,
                    dict(TOP_K=top_k, HIDDEN=hidden, INTER=inter, BLOCK_N=tiles.block_n_up) | common,
                    pointers=_POINTERS | weights | {k: v for k, v in inputs.items() if k == "x_ptr"},
                    num_warps=tiles.num_warps,
                    num_stages=tiles.num_stages,
                )
                yield KernelConfig(
                    f"moe.experts {label}down {name} block_m={tiles.block_m}",
                    experts_triton._moe_down_kernel,
                    dict(HIDDEN=hidden, INTER=inter, BLOCK_N=tiles.block_n_down) | common,
                    pointers=_POINTERS | weights | {k: v for k, v in inputs.items() if k == "act_ptr"},
                    num_warps=tiles.num_warps,
                    num_stages=tiles.num_stages,
                )
