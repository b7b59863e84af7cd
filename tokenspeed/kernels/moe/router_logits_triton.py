"""Triton `moe.router_logits` (name "triton"): fp32 router logits of x `[T, H]` and an fp32 weight `[E, H]`.

Every transformers router computes its logits in fp32, so the engine keeps
the router weight in fp32 and, as the reference
(`routing_reference.router_logits_reference`), runs `F.linear(x.float(),
weight)`. At decode that is three launches for a 1 MB product in every MoE
layer, the cast of x and cuBLAS's fp32 GEMV (a dot kernel and a reduction):
6.8 us of a Qwen3-30B-A3B layer's ~70 us in an FP8 bs1 step on an H100
(`benchmarks/fp8_e2e.py --sections qwen3_moe --profile`, 2026-12-06).

`router_logits_triton` is one launch: a program owns BLOCK_E experts of one
token and reads x in its own dtype, widening to fp32 in registers; products
and sums are fp32 (an fp32 register tile, one reduction at the end), so the
logits differ from cuBLAS's only in summation order. Every program re-reads
its experts' rows (from L2), so the kernel's time grows with the tokens:
2.5 us a layer at 1 token, 11.1 at 64, where cuBLAS and the cast take 9.6;
it serves up to `ROUTER_TRITON_MAX_TOKENS` and larger batches keep cuBLAS
(`layers/moe.Router`; `benchmarks/results/h100/wave2/moe_router_2026-12-06/`).
The reference is also the off switch: `--kernel moe.router_logits=reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.moe import ROUTER_TRITON_MAX_TOKENS
from tokenspeed.kernels.moe.routing_reference import check_router_args
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2

BLOCK_E = 2  # experts a program: 64 programs a token for 128 experts, 128 for DeepSeek-V3's 256
BLOCK_K = 1024


@triton.jit
def _router_logits_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_out,
    E: tl.constexpr,
    H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    token = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    e_ok = experts < E
    rows = w_ptr + experts.to(tl.int64)[:, None] * H
    tile = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=2):
        k = k0 + offs_k
        k_ok = k < H
        x = tl.load(x_ptr + token * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(rows + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        tile += w * x[None, :]
    tl.store(out_ptr + token * stride_out + experts, tl.sum(tile, 1), mask=e_ok)


@register_kernel(
    "moe",
    "router_logits",
    name="triton",
    band=Band.PORTABLE,
    platforms=("cuda",),
    dtypes=FLOAT_DTYPES,
    workload={"num_tokens": (1, ROUTER_TRITON_MAX_TOKENS)},
)
def router_logits_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As `router_logits_reference`, in one launch (module docstring)."""
    check_router_args(x, weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, hidden = x.shape
    experts = weight.shape[0]
    out = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    if tokens:
        for_tensor(_router_logits_kernel, x)[(triton.cdiv(experts, BLOCK_E), tokens)](
            x, weight.contiguous(), out, x.stride(0), out.stride(0),
            E=experts, H=hidden, BLOCK_E=BLOCK_E, BLOCK_K=min(BLOCK_K, next_power_of_2(hidden)),
            num_warps=4,
        )  # fmt: skip
    return out
