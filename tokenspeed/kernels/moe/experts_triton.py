"""Triton fused MoE: two grouped GEMMs over expert-sorted (token, k) pairs.

Signature: as `experts_reference.fused_experts_reference` (registered as
`moe.experts`, name "triton", band PERFORMANT, cuda, any token count). It
outranks `experts_grouped_mm` at every size because it measured faster at every
size: 1.4-2.0x over 16-16384 tokens for the Moonlight and Qwen3-30B-A3B shapes
on the H200 (`benchmarks/results/h200_moe_kernels.json`).

Steps (no host sync anywhere, so the whole op can be captured in a CUDA graph):
1. `align.align_by_expert` sorts the T*k pairs by expert and pads each
   expert's run to BLOCK_M rows, so every row block of the GEMMs below reads
   a single expert's weights (decode-sized batches use the single-launch
   `align_triton.align_by_expert_triton`, same result);
2. `_moe_gate_up_kernel`: for each block, gather the pairs' token rows of
   `hidden`, multiply by the expert's gate and up projections (two
   accumulators over the same A tile) and write silu(gate) * up for each pair,
   i.e. the SiLU-and-mul is fused into the GEMM epilogue and the [T*k, 2I]
   gate/up product never reaches memory;
3. `_moe_down_kernel`: multiply those rows by the expert's down projection,
   scale by the pair's routing weight and store row `pair` of a [T*k, H] buffer;
4. the k-sum of each token's pair rows (pairs are indexed token-major), in
   order and in fp32 (`sum_pairs`: one launch; deterministic, unlike atomics
   into the output). At Qwen3-30B-A3B's shape on an H100 it takes 1.1 us a
   layer at 1 token and 2.2 at 64, where torch's generic reduction of
   `view(T, k, H).sum(1)` took 5.0 and 6.2
   (`benchmarks/results/h100/wave2/moe_router_2026-12-06/`);
   `TOKENSPEED_MOE_TRITON_SUM=0` keeps torch's.

Rounding mirrors the reference where it is free: gate and up are rounded to
the activation dtype before the activation, the activation before the product.
Each routed row is rounded to the activation dtype once, after the routing
weight is applied (the reference rounds the expert output before weighting),
and the k-sum accumulates in fp32; the GPU tests bound the difference.

Tile sizes come from `tile_config`, keyed on the mean pairs per expert (what
decides how full a BLOCK_M-row block is): decode-sized batches are weight-
bandwidth bound and use 16-row blocks with long K steps and 4 pipeline
stages; prefill uses 128-row blocks on 8 warps (Hopper wgmma tiles).

FP8 experts (`W_FP8`, launched by `experts_fp8_triton`): weights fp8 with a
scale per (row block, K block); each K tile's product is scaled in fp32
before it is accumulated (`_fp8_step`), so BLOCK_K must divide the scale
block. The activations are either kept in their dtype against widened
weights or, with `A_FP8`, quantised per token and group of 128 (fp8 x fp8
tensor cores). Kept bf16 activations meet the weights in fp16 (`F16_DOTS`):
e4m3 widens to fp16 with one instruction per pair, to bf16 only through a
further conversion per value, which capped the decode path near half the
weight bandwidth on the H200 (as it did fp8 attention); the activation tile
is converted to fp16 saturating at +-65504 (`fp8_cast.to_f16_saturated`;
post-norm hidden states and the SiLU-gated intermediate stay far below).
With the flags off the kernels compile exactly as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.attention.paged_tiles import dot
from tokenspeed.kernels.moe.align import BlockAlignment, align_by_expert
from tokenspeed.kernels.moe.align_triton import ALIGN_TRITON_MAX_PAIRS, align_by_expert_triton
from tokenspeed.kernels.moe.experts_reference import check_experts_args
from tokenspeed.kernels.quant.fp8 import GROUP_SIZE
from tokenspeed.kernels.quant.fp8_cast import to_f16_saturated, widen_fp8
from tokenspeed.kernels.quant.quantize_triton import quantize_per_token_group_triton
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Tiles of both GEMMs; `block_n_up` counts columns of *each* of gate and up."""

    block_m: int
    block_n_up: int
    block_n_down: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# Chosen for H200 (sm_90) from the usual Hopper tile shapes, not yet measured one by one
# (`benchmarks/moe_kernels.py` reports the achieved rate); keyed on the mean pairs per
# expert, T*k/E (upper bounds, inclusive). compile_configs.py checks them for spills.
# Decode: 32-column gate/up tiles so a single token's k experts still spread over
# the SMs (k * I / 32 programs: 192 for Qwen3-30B-A3B), two programs resident per SM.
DECODE_TILES = TileConfig(block_m=16, block_n_up=32, block_n_down=64, block_k=128, num_warps=4, num_stages=4)
MEDIUM_TILES = TileConfig(block_m=64, block_n_up=64, block_n_down=128, block_k=64, num_warps=4, num_stages=4)
PREFILL_TILES = TileConfig(
    block_m=128, block_n_up=64, block_n_down=128, block_k=64, num_warps=8, num_stages=3
)
DECODE_MAX_PAIRS_PER_EXPERT = 16
MEDIUM_MAX_PAIRS_PER_EXPERT = 64


def tile_config(num_tokens: int, top_k: int, num_experts: int) -> TileConfig:
    """Tiles for this batch: row blocks sized to how many pairs an expert gets on average."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= DECODE_MAX_PAIRS_PER_EXPERT:
        return DECODE_TILES
    if per_expert <= MEDIUM_MAX_PAIRS_PER_EXPERT:
        return MEDIUM_TILES
    return PREFILL_TILES


@triton.jit
def _block_coordinates(num_m_blocks, N: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program; GROUP_M row blocks share each weight tile while it is in L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % width) % group_size, (pid % width) // group_size


@triton.jit
def _fp8_step(a, w, a_scales, w_scales, k0, row_ok, w_ok, SCALE_BK: tl.constexpr, GROUP_K: tl.constexpr,
              A_FP8: tl.constexpr, F16_DOTS: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """One K tile of an fp8-weight GEMM as fp32 `[BLOCK_M, BLOCK_N]`, its scales applied.

    `w` is fp8 with a scale per (row block, K block) at `w_scales + k0 // SCALE_BK`;
    `a` is fp8 with a scale per (row, 128 group) (`A_FP8`: fp8 tensor cores), or
    in the activation dtype, which the weight tile is widened to; with
    `F16_DOTS` (bf16 activations) both are taken to fp16 instead (see the
    module docstring).
    """
    w_scale = tl.load(w_scales + k0 // SCALE_BK, mask=w_ok, other=0.0)
    if A_FP8:
        a_scale = tl.load(a_scales + k0 // GROUP_K, mask=row_ok, other=0.0)
        return tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
    if F16_DOTS:
        return dot(to_f16_saturated(a), widen_fp8(w, tl.float16, False), IEEE) * w_scale[None, :]
    return dot(a, w.to(a.dtype), IEEE) * w_scale[None, :]


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    num_m_blocks,
    stride_x,
    stride_we,
    stride_wn,
    stride_act,
    x_scale_ptr,
    w_scale_ptr,
    stride_xs,
    stride_wse,
    stride_wsn,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
    W_FP8: tl.constexpr,
    A_FP8: tl.constexpr,
    F16_DOTS: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    pid_m, pid_n = _block_coordinates(num_m_blocks, INTER, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_x + offs_k[None, :]
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + INTER * stride_wn
    x_scales = x_scale_ptr + token * stride_xs
    gate_scales = w_scale_ptr + expert.to(tl.int64) * stride_wse + (offs_n // SCALE_BN) * stride_wsn
    up_scales = w_scale_ptr + expert.to(tl.int64) * stride_wse + ((INTER + offs_n) // SCALE_BN) * stride_wsn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k_ok = offs_k < HIDDEN - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate_w = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up_w = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if W_FP8:
            acc_gate += _fp8_step(
                a, gate_w, x_scales, gate_scales, k0, row_ok, n_ok, SCALE_BK, GROUP_K, A_FP8, F16_DOTS, IEEE
            )
            acc_up += _fp8_step(
                a, up_w, x_scales, up_scales, k0, row_ok, n_ok, SCALE_BK, GROUP_K, A_FP8, F16_DOTS, IEEE
            )
        elif IEEE:
            acc_gate = tl.dot(a, gate_w, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, up_w, acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, gate_w, acc_gate)
            acc_up = tl.dot(a, up_w, acc_up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    out_ptrs = act_ptr + pair.to(tl.int64)[:, None] * stride_act + offs_n[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    num_m_blocks,
    stride_act,
    stride_we,
    stride_wn,
    stride_out,
    act_scale_ptr,
    w_scale_ptr,
    stride_as,
    stride_wse,
    stride_wsn,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
    W_FP8: tl.constexpr,
    A_FP8: tl.constexpr,
    F16_DOTS: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    pid_m, pid_n = _block_coordinates(num_m_blocks, HIDDEN, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    rows = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_act + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    a_scales = act_scale_ptr + rows * stride_as
    w_scales = w_scale_ptr + expert.to(tl.int64) * stride_wse + (offs_n // SCALE_BN) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_ok = offs_k < INTER - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if W_FP8:
            acc += _fp8_step(a, w, a_scales, w_scales, k0, row_ok, n_ok, SCALE_BK, GROUP_K, A_FP8, F16_DOTS, IEEE)
        elif IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    routing = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    acc = acc * routing[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True, slots=True)
class Fp8ExpertWeights:
    """Block scales of fp8 expert weights (`w13_scale [E, 2I/bn, H/bk]`, `w2_scale [E, H/bn, I/bk]`).

    `quantize_activations`: fp8 x fp8 tensor cores on activations quantised
    per token and group of 128, else activations stay in their dtype and
    each weight tile is widened to it.
    """

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block_size: tuple[int, int]
    quantize_activations: bool


def _fp8_args(
    activation: torch.Tensor, weight_scale: torch.Tensor, fp8: Fp8ExpertWeights | None
) -> tuple[torch.Tensor, list[Any], dict[str, Any]]:
    """(GEMM input, scale pointers and strides, fp8 constexprs) of one grouped GEMM."""
    if fp8 is None:
        return activation, [activation, activation, 0, 0, 0], _NO_FP8
    a_scale = activation
    if fp8.quantize_activations:
        activation, a_scale = quantize_per_token_group_triton(activation)
    scale = weight_scale.contiguous()
    pointers = [a_scale, scale, a_scale.stride(0), scale.stride(0), scale.stride(1)]
    bn, bk = fp8.block_size
    flags = dict(W_FP8=True, A_FP8=fp8.quantize_activations, SCALE_BN=bn, SCALE_BK=max(bk, GROUP_SIZE))
    f16_dots = not fp8.quantize_activations and activation.dtype == torch.bfloat16
    return activation, pointers, flags | dict(F16_DOTS=f16_dots, GROUP_K=GROUP_SIZE)


_NO_FP8: dict[str, Any] = dict(W_FP8=False, A_FP8=False, F16_DOTS=False, SCALE_BN=1, SCALE_BK=1, GROUP_K=GROUP_SIZE)


def launch_grouped_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    alignment: BlockAlignment,
    top_k: int,
    tiles: TileConfig,
    fp8: Fp8ExpertWeights | None = None,
) -> torch.Tensor:
    """The two grouped GEMMs over an existing alignment; returns the weighted pair rows [T*k, H]."""
    tokens, hidden_size = hidden.shape
    inter = w2.shape[2]
    num_pairs = tokens * top_k
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    blocks = alignment.num_blocks
    if num_pairs == 0 or blocks == 0:
        return pair_out
    ieee = hidden.dtype == torch.float32
    common = dict(BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, IEEE=ieee)
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    x, scales, flags = _fp8_args(hidden, fp8.w13_scale if fp8 else w13, fp8)
    grid_up = (blocks * triton.cdiv(inter, tiles.block_n_up),)
    for_tensor(_moe_gate_up_kernel, hidden)[grid_up](
        x, w13, act, alignment.pair_ids, alignment.block_expert, num_pairs, blocks,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *scales,
        TOP_K=top_k, HIDDEN=hidden_size, INTER=inter, BLOCK_N=tiles.block_n_up, **common, **flags, **launch,
    )  # fmt: skip
    a, scales, flags = _fp8_args(act, fp8.w2_scale if fp8 else w2, fp8)
    grid_down = (blocks * triton.cdiv(hidden_size, tiles.block_n_down),)
    for_tensor(_moe_down_kernel, hidden)[grid_down](
        a, w2, pair_out, alignment.pair_ids, alignment.block_expert, topk_weights.reshape(-1), num_pairs,
        blocks, a.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0), *scales,
        HIDDEN=hidden_size, INTER=inter, BLOCK_N=tiles.block_n_down, **common, **flags, **launch,
    )  # fmt: skip
    return pair_out


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """`align_by_expert`, in one launch (`align_triton`) for decode-sized batches."""
    if topk_ids.numel() <= ALIGN_TRITON_MAX_PAIRS:
        return align_by_expert_triton(topk_ids, num_experts, block_m)
    return align_by_expert(topk_ids, num_experts, block_m)


@triton.jit
def _sum_pairs_kernel(pairs_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (token * TOP_K + k) * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


SUM_BLOCK_H = 512


def sum_pairs(pair_out: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """`[T, H]`: each token's k weighted pair rows of `pair_out` `[T*k, H]` summed in fp32, rounded once."""
    hidden = pair_out.shape[1]
    if os.environ.get("TOKENSPEED_MOE_TRITON_SUM", "1") == "0" or tokens == 0:
        return pair_out.view(tokens, top_k, hidden).sum(dim=1)
    out = torch.empty(tokens, hidden, dtype=pair_out.dtype, device=pair_out.device)
    for_tensor(_sum_pairs_kernel, pair_out)[(tokens, triton.cdiv(hidden, SUM_BLOCK_H))](
        pair_out, out, H=hidden, TOP_K=top_k, BLOCK_H=SUM_BLOCK_H, num_warps=4
    )
    return out


@register_kernel(
    "moe", "experts", name="triton", band=Band.PERFORMANT, platforms=("cuda",), dtypes=FLOAT_DTYPES
)
def fused_experts_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * Expert_{topk_ids[:, k]}(hidden); `tiles` overrides `tile_config` (tests)."""
    tokens, hidden_size, _, experts = check_experts_args(hidden, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    tiles = tiles or tile_config(tokens, top_k, experts)
    alignment = align_pairs(topk_ids, experts, tiles.block_m)
    weights = topk_weights.to(torch.float32).contiguous()
    pair_out = launch_grouped_experts(hidden, w13, w2, weights, alignment, top_k, tiles)
    return sum_pairs(pair_out, tokens, top_k)
