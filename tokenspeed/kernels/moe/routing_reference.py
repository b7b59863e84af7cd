"""Reference MoE routing: router logits -> (top-k weights, top-k expert ids).

Signature (registered as `moe.route`, name "reference", cpu and cuda)::

    route_reference(router_logits: Tensor[T, E], *, top_k, scoring, renormalize,
                    num_groups=None, topk_groups=None, group_scoring="max",
                    correction_bias=None, routed_scaling_factor=1.0)
        -> (topk_weights: fp32 [T, top_k], topk_ids: int32 [T, top_k])

Everything is computed in fp32 whatever the logits' dtype, as every
transformers router does. Steps:

1. scores = softmax(logits) (`scoring="softmax"`) or sigmoid(logits) (`"sigmoid"`);
2. choice = scores + correction_bias (DeepSeek-V3's `e_score_correction_bias`;
   the bias steers *which* experts are chosen, never their weights);
3. with `num_groups`, experts are split into equal contiguous groups, each group
   is scored (`group_scoring="max"`: best choice score in the group, DeepSeek-V2
   `group_limited_greedy`; `"top2_sum"`: sum of the two best, DeepSeek-V3
   `noaux_tc`), the `topk_groups` best groups are kept and the rest masked out;
4. ids = top-k of the (masked) choice scores; weights = the *unbiased* scores at ids;
5. if `renormalize`: weights /= (sum of weights + 1e-20);
6. weights *= routed_scaling_factor.

How each model maps onto it (what the parity tests check against transformers):

- Qwen3-MoE: softmax, renormalize = norm_topk_prob.
- Mixtral: softmax, renormalize=True (top-k then softmax over the k is the same thing).
- DeepSeek-V2 `greedy` / `group_limited_greedy` (group_scoring "max"): softmax,
  renormalize=False and routed_scaling_factor from the config: transformers'
  DeepseekV2TopkRouter always scales and ignores norm_topk_prob (the original
  remote code normalised *instead of* scaling when norm_topk_prob was set;
  pass renormalize=True, routed_scaling_factor=1.0 to get that behaviour).
- DeepSeek-V3 / Moonlight `noaux_tc`: sigmoid, correction_bias, group_scoring
  "top2_sum", renormalize = norm_topk_prob, then routed_scaling_factor.

Masked experts get -inf choice scores, so a masked expert is never chosen
while `top_k` <= experts in the kept groups (V2 masks softmax scores to 0.0
instead; the two only differ when top_k exceeds the experts kept, which no
config does). The order of the k columns is unspecified (consumers sum over k).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenspeed.kernels.registry import Band, register_kernel

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORINGS = ("max", "top2_sum")
RENORM_EPS = 1e-20  # DeepSeek-V3's denominator guard


def check_route_args(
    num_experts: int,
    *,
    top_k: int,
    scoring: str,
    num_groups: int | None,
    topk_groups: int | None,
    group_scoring: str,
) -> None:
    """Raise ValueError for an inconsistent routing configuration (shared by every `moe.route` kernel)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if group_scoring not in GROUP_SCORINGS:
        raise ValueError(f"group_scoring must be one of {GROUP_SCORINGS}, got {group_scoring!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}]")
    if num_groups is None:
        return
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the {num_experts} experts")
    kept = num_groups if topk_groups is None else topk_groups
    if not 1 <= kept <= num_groups:
        raise ValueError(f"topk_groups={topk_groups} must be in [1, {num_groups}]")
    if group_scoring == "top2_sum" and num_experts // num_groups < 2:
        raise ValueError("group_scoring='top2_sum' needs at least two experts per group")
    if top_k > kept * (num_experts // num_groups):
        raise ValueError(f"top_k={top_k} exceeds the experts in {kept} kept groups")


def route_inputs(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    scoring: str,
    num_groups: int | None,
    topk_groups: int | None,
    group_scoring: str,
) -> tuple[torch.Tensor, int, int]:
    """Checked `moe.route` input (see `check_route_args`): logits as [T, E], groups, groups kept (1, 1 ungrouped)."""
    num_experts = router_logits.shape[-1]
    check_route_args(
        num_experts,
        top_k=top_k,
        scoring=scoring,
        num_groups=num_groups,
        topk_groups=topk_groups,
        group_scoring=group_scoring,
    )
    groups = num_groups or 1
    kept = groups if topk_groups is None else topk_groups
    return router_logits.reshape(-1, num_experts), groups, kept


def group_mask(choice: torch.Tensor, num_groups: int, topk_groups: int, group_scoring: str) -> torch.Tensor:
    """Bool [T, E]: True for experts in the `topk_groups` best-scoring groups of each row."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    if group_scoring == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep_groups = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
    return keep.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, experts)


@register_kernel("moe", "route", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def route_reference(
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
    """(fp32 weights [T, top_k], int32 expert ids [T, top_k]); see the module docstring."""
    logits, groups, kept = route_inputs(
        router_logits,
        top_k=top_k,
        scoring=scoring,
        num_groups=num_groups,
        topk_groups=topk_groups,
        group_scoring=group_scoring,
    )
    logits = logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if kept < groups:
        choice = choice.masked_fill(~group_mask(choice, groups, kept, group_scoring), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def check_router_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """x `[T, H]` against an fp32 router weight `[E, H]` (the engine keeps it in fp32), or ValueError."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        shapes = f"{tuple(x.shape)}, {tuple(weight.shape)}"
        raise ValueError(f"router logits need x [T, H] and weight [E, H], got {shapes}")
    if weight.dtype != torch.float32:
        raise ValueError(f"the router weight is fp32, got {weight.dtype}")


@register_kernel("moe", "router_logits", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def router_logits_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits `[T, E]` of x `[T, H]` (any float dtype) and the fp32 router weight `[E, H]`:
    x widened to fp32, then `F.linear`, as transformers' routers compute them (`router_logits_triton`
    is the one-launch form for decode batches)."""
    check_router_args(x, weight)
    return F.linear(x.float(), weight)
