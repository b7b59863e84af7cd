"""Reference sampler: the row-by-row torch algorithm, on tensors.

`draw_row_reference` is the one keyed draw of the engine: the executor's
sampler (`executor/sampler.py`) calls it for each random row on the CPU and
whenever a step has penalties, and `sample_reference` (the REFERENCE kernel of
`sampling.sample`) loops it over a batch, so it is the oracle of the Triton
kernel as well. The Triton kernel uses Philox instead of torch's generator, so
it matches this reference in distribution, not token for token.
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.registry import Band, register_kernel
from tokenspeed.kernels.sampling.keys import mix_seed
from tokenspeed.scheduler.sampling_params import GREEDY_EPSILON


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


def draw_row_reference(
    logits_row: torch.Tensor, *, temperature: float, top_k: int, top_p: float, min_p: float, key: int
) -> torch.Tensor:
    """One draw from one row of logits with the exponential-race trick, keyed by `key`.

    softmax(logits / temperature), then the filters, then argmax(p / E) with E
    exponential from a torch generator seeded by `key`: P(token) is its kept
    probability, and the same key always draws the same token. Returns a 0-d
    int64 tensor on the logits' device, so a caller that keeps sampled ids on
    the device (overlap scheduling) never waits for the host.
    """
    probs = torch.softmax(logits_row.float() / temperature, dim=-1)
    probs = filter_probs_reference(probs, top_k, top_p, min_p)
    generator = torch.Generator(device=probs.device)
    generator.manual_seed(key)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / race)


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
        token = draw_row_reference(
            logits[row], temperature=temp, top_k=int(k), top_p=float(p), min_p=float(m),
            key=mix_seed(int(seed), int(index)),
        )
        tokens.append(int(token.item()))
    return torch.tensor(tokens, dtype=torch.int64, device=logits.device)


@register_kernel("sampling", "argmax", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """int64 `[rows]`: each row's first argmax. A long row is reduced in two stages on a GPU: one block per
    row takes ~27 us on 128K logits, 64 chunks in parallel then one small pass take a few."""
    rows, vocab = logits.shape
    chunks = next((c for c in (64, 32, 16) if vocab % c == 0 and vocab // c >= 1024), 1)
    if chunks == 1 or not logits.is_cuda:
        return torch.argmax(logits, dim=-1)
    values, index = logits.view(rows, chunks, vocab // chunks).max(dim=-1)
    best = torch.argmax(values, dim=-1, keepdim=True)  # first chunk holding the maximum
    return (best.squeeze(1) * (vocab // chunks) + index.gather(1, best).squeeze(1)).to(torch.int64)
