"""Triton MoE routing: the whole of `routing_reference.route_reference` in one launch.

Signature and semantics: exactly those of `route_reference` (registered as
`moe.route`, name "triton", band PORTABLE, cuda). Why a kernel: the torch
reference is a dozen small ops (softmax, group scores, two top-ks, masks, a
gather, the renormalisation), each a launch that a decode step pays in every
MoE layer; here one program routes one token with the expert scores in
registers (E <= a few hundred). The scaling factor and epsilon are
compile-time constants (one value per model).

Per token: scores (softmax or sigmoid, fp32), choice = scores + bias; with
groups, each group's score (max or sum of the best two) from a
[groups x experts] membership tile, the best `topk_groups` groups kept by
repeated argmax and the other experts masked to -inf; then `top_k` rounds
of argmax over the choice scores, each taking the *unbiased* score as the
weight and removing the winner; renormalise (+1e-20) and scale. Ids come
out in descending choice order. Ties break to the lower expert id (torch's
top-k leaves them unspecified); the tests use tie-free inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed.kernels.moe.routing_reference import RENORM_EPS, route_inputs
from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.triton_launch import FLOAT_DTYPES, for_tensor, next_power_of_2


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    GROUP_TOP2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALING: tl.constexpr,
    EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < NUM_EXPERTS
    x = tl.load(logits_ptr + row * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if TOPK_GROUPS < NUM_GROUPS:
        groups = tl.arange(0, BLOCK_G)
        member = (experts[None, :] // (NUM_EXPERTS // NUM_GROUPS)) == groups[:, None]
        member = member & valid[None, :]
        tile = tl.where(member, choice[None, :], float("-inf"))
        best = tl.max(tile, axis=1)
        if GROUP_TOP2:
            first = tl.argmax(tile, axis=1)
            second = tl.max(tl.where(experts[None, :] == first[:, None], float("-inf"), tile), axis=1)
            best = best + second
        group_score = tl.where(groups < NUM_GROUPS, best, float("-inf"))
        keep = tl.zeros((BLOCK_G,), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            winner = tl.argmax(tl.where(keep, float("-inf"), group_score), axis=0)
            keep = keep | (groups == winner)
        kept = tl.max((member & keep[:, None]).to(tl.int32), axis=0) > 0
        choice = tl.where(kept, choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    top_ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    top_weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        winner = tl.argmax(choice, axis=0)
        weight = tl.sum(tl.where(experts == winner, scores, 0.0), axis=0)
        top_ids = tl.where(slots == i, winner, top_ids)
        top_weights = tl.where(slots == i, weight, top_weights)
        choice = tl.where(experts == winner, float("-inf"), choice)
    if RENORMALIZE:
        top_weights = top_weights / (tl.sum(top_weights, axis=0) + EPS)
    top_weights = top_weights * SCALING
    tl.store(weights_ptr + row * TOP_K + slots, top_weights, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, top_ids, mask=slots < TOP_K)


def num_warps_for(num_experts: int) -> int:
    """One warp holds up to 128 scores in 4 registers a lane; more experts get a 4-warp program."""
    return 1 if next_power_of_2(num_experts) <= 128 else 4


@register_kernel("moe", "route", name="triton", band=Band.PORTABLE, platforms=("cuda",), dtypes=FLOAT_DTYPES)
def route_triton(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    scoring: str,
    renormalize: bool,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    group_scoring: str = "max",
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, top_k], int32 expert ids [T, top_k]); see `route_reference`."""
    logits, groups, kept = route_inputs(
        router_logits,
        top_k=top_k,
        scoring=scoring,
        num_groups=num_groups,
        topk_groups=topk_groups,
        group_scoring=group_scoring,
    )
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    block_e = next_power_of_2(num_experts)
    if tokens:
        bias = correction_bias if correction_bias is not None else logits
        for_tensor(_route_kernel, logits)[(tokens,)](
            logits, bias.contiguous(), weights, ids, logits.stride(0),
            NUM_EXPERTS=num_experts, TOP_K=top_k, SIGMOID=scoring == "sigmoid",
            HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize, NUM_GROUPS=groups,
            TOPK_GROUPS=kept, GROUP_TOP2=group_scoring == "top2_sum", BLOCK_E=block_e,
            BLOCK_G=next_power_of_2(groups), BLOCK_K=next_power_of_2(top_k),
            SCALING=float(routed_scaling_factor), EPS=RENORM_EPS,
            num_warps=num_warps_for(num_experts),
        )  # fmt: skip
    return weights, ids
