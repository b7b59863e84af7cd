"""Reference routed experts: out[t] = sum_k w[t, k] * Expert_{id[t, k]}(hidden[t]).

Signature (registered as `moe.experts`, name "reference", cpu and cuda)::

    fused_experts_reference(hidden: Tensor[T, H], w13: Tensor[E, 2*I, H], w2: Tensor[E, H, I],
                            topk_weights: fp32 [T, k], topk_ids: int32 [T, k]) -> Tensor[T, H]

Each expert is a SwiGLU MLP: rows 0..I-1 of `w13[e]` are the gate projection
and rows I..2I-1 the up projection (transformers' `gate_up_proj` layout), so
Expert_e(x) = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)). Ids must lie in [0, E).

Numerics, chosen so fp32 results match transformers' expert loop to rounding
and bf16 results are at least as accurate as it is:
- each expert's two GEMMs and the activation run in the input dtype (as the
  model's own linear layers would);
- the expert output is multiplied by its fp32 routing weight and accumulated
  over k in an fp32 buffer (transformers accumulates in the activation dtype,
  which for bf16 rounds after every expert), cast to the input dtype at the end;
- experts are visited in ascending id order with `index_add_`, the order of
  transformers' loop, so the fp32 k-sum adds the same terms in the same order.

The loop reads the per-expert token counts on the host, so this kernel syncs
and cannot be captured in a CUDA graph; it is the oracle, not a serving path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenspeed.kernels.registry import Band, register_kernel


def check_experts_args(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> tuple[int, int, int, int]:
    """(tokens, hidden size, intermediate size, experts) after checking the shapes agree."""
    tokens, hidden_size = hidden.shape
    experts, two_inter, w13_hidden = w13.shape
    inter = two_inter // 2
    if two_inter % 2 or w13_hidden != hidden_size:
        raise ValueError(f"w13 {tuple(w13.shape)} must be [E, 2*I, {hidden_size}]")
    if tuple(w2.shape) != (experts, hidden_size, inter):
        raise ValueError(f"w2 {tuple(w2.shape)} must be {(experts, hidden_size, inter)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [{tokens}, k]"
        )
    return tokens, hidden_size, inter, experts


def routed_experts_loop(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    requantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The expert loop of `fused_experts_reference`, with each expert's (w13, w2) fetched by `expert_weights(e)`.

    Fetching per expert lets the FP8 reference dequantise only the experts a
    batch uses; `requantize`, applied to each GEMM's input rows, lets it mimic
    kernels that quantise their activations.
    """
    tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    out = torch.zeros(tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, ascending
    pair_tokens = order // top_k
    pair_weights = topk_weights.reshape(-1).float()[order]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    same = requantize or (lambda rows: rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        w13, w2 = expert_weights(expert)
        inter = w13.shape[0] // 2
        rows = pair_tokens[start : start + count]
        gate_up = F.linear(same(hidden.index_select(0, rows)), w13)
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        expert_out = F.linear(same(act), w2)
        out.index_add_(0, rows, expert_out.float() * pair_weights[start : start + count, None])
        start += count
    return out.to(hidden.dtype)


@register_kernel("moe", "experts", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def fused_experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * Expert_{topk_ids[:, k]}(hidden), in hidden's dtype."""
    experts = check_experts_args(hidden, w13, w2, topk_weights, topk_ids)[3]
    return routed_experts_loop(hidden, topk_weights, topk_ids, experts, lambda e: (w13[e], w2[e]))
