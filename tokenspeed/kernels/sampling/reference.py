"""Reference batched sampler: the row-by-row torch algorithm of `layers/sampler.py`, on tensors.

Given the same key it draws the very token `layers.sampler.random_draw` draws
(same filters, same torch generator seeding, same exponential race), so it is
the oracle for both the Python sampler and the Triton kernel. The Triton kernel
uses Philox instead of torch's generator, so it matches this reference in
distribution, not token for token.
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.sampling.keys import mix_seed

GREEDY_EPSILON = 1e-5  # temperature below this means argmax (as SamplingParams.greedy)


def filter_probs_reference(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """min-p, then top-k, then top-p on one row of (temperature-scaled) probabilities."""
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), torch.zeros_like(probs), probs)
    if 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (cumulative - sorted_probs) >= top_p * cumulative[-1]
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = torch.where(drop, torch.zeros_like(probs), probs)
    return probs


@register_kernel("sampling", "sample", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per row of logits `[rows, vocab]`; parameters are `[rows]` tensors. Returns int64 `[rows]`.

    temperature < 1e-5 means greedy (argmax; other parameters ignored); top_k <= 0
    and top_p == 1 disable those filters. Draws are keyed by (seeds[i], sample_indices[i]).
    """
    params = zip(
        temperature.tolist(),
        top_k.tolist(),
        top_p.tolist(),
        min_p.tolist(),
        seeds.tolist(),
        sample_indices.tolist(),
    )
    tokens: list[int] = []
    for row, (temp, k, p, m, seed, index) in enumerate(params):
        if temp < GREEDY_EPSILON:
            tokens.append(int(torch.argmax(logits[row]).item()))
            continue
        probs = torch.softmax(logits[row].float() / temp, dim=-1)
        probs = filter_probs_reference(probs, int(k), float(p), float(m))
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(mix_seed(int(seed), int(index)))
        race = torch.empty_like(probs).exponential_(generator=generator)
        tokens.append(int(torch.argmax(probs / race).item()))
    return torch.tensor(tokens, dtype=torch.int64, device=logits.device)
