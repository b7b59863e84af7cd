"""Token sampling: penalties, min-tokens masking, greedy / random draws, logprobs.

Randomness is keyed, not stateful: each draw uses a generator seeded from
`(stream seed, sample_index)`. A request therefore produces the same tokens
whatever it is batched with, whenever it is preempted and recomputed, and
whichever step it lands in — the property the fast-path equivalence tests
rely on, and the one a Philox-based GPU sampler keeps for free.

Logprobs are "raw": computed from the model's logits before penalties and
temperature, as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed.scheduler.plan import TokenLogprob
from tokenspeed.scheduler.sampling_params import SamplingParams

_MASK = float("-inf")
_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class SampleSpec:
    """One draw: the request's parameters, its history and the draw's key."""

    sampling: SamplingParams
    seed: int
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def draw_seed(seed: int, sample_index: int) -> int:
    """Mix a stream seed and a position into one generator seed (splitmix64-style)."""
    z = (seed * _SEED_MIX + sample_index + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _SEED_MASK


def apply_penalties(logits: torch.Tensor, specs: list[SampleSpec]) -> None:
    """Repetition (prompt + output, HF/vLLM rule), frequency and presence (output only), in place."""
    for i, spec in enumerate(specs):
        params = spec.sampling
        if not params.needs_penalties:
            continue
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(spec.prompt_token_ids) | set(spec.output_token_ids)), dtype=torch.int64)
            seen = seen.to(row.device)
            values = row.index_select(0, seen)
            values = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
            row.index_copy_(0, seen, values)
        if spec.output_token_ids and (params.frequency_penalty or params.presence_penalty):
            out = torch.tensor(spec.output_token_ids, dtype=torch.int64, device=row.device)
            counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def mask_stop_tokens_before_min(logits: torch.Tensor, specs: list[SampleSpec]) -> None:
    """Forbid stop tokens until `min_tokens` are out, so min_tokens is honoured, not merely delayed."""
    for i, spec in enumerate(specs):
        if spec.sample_index < spec.sampling.min_tokens:
            stop = sorted(spec.sampling.stop_ids())
            if stop:
                logits[i, stop] = _MASK


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """min-p, then top-k, then top-p on one row of probabilities (already temperature-scaled)."""
    if params.min_p > 0.0:
        probs = torch.where(probs < params.min_p * probs.max(), torch.zeros_like(probs), probs)
    if 0 < params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (cumulative - sorted_probs) >= params.top_p * cumulative[-1]
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = torch.where(drop, torch.zeros_like(probs), probs)
    return probs


def random_draw_tensor(logits_row: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """Sample one token with the exponential-race trick, keyed by (seed, sample_index).

    Returns a 0-d int64 tensor on the logits' device, so a caller that keeps
    sampled ids on the device (overlap scheduling) never waits for the host.
    """
    params = spec.sampling
    probs = torch.softmax(logits_row.float() / params.temperature, dim=-1)
    probs = filter_probs(probs, params)
    generator = torch.Generator(device=probs.device)
    generator.manual_seed(draw_seed(spec.seed, spec.sample_index))
    race = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / race)


def random_draw(logits_row: torch.Tensor, spec: SampleSpec) -> int:
    return int(random_draw_tensor(logits_row, spec).item())


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], top_k: int) -> list[TokenLogprob]:
    """Chosen-token logprob, its rank (1 = best) and the top-k alternatives, per row."""
    chosen = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1)
    ranks = (logprobs > chosen_lp[:, None]).sum(dim=1) + 1
    k = min(top_k, logprobs.shape[1])
    top_values, top_ids = (torch.topk(logprobs, k, dim=1) if k > 0 else (None, None))
    out: list[TokenLogprob] = []
    chosen_list, ranks_list = chosen_lp.tolist(), ranks.tolist()
    for i, token_id in enumerate(token_ids):
        top: list[tuple[int, float]] = []
        if top_values is not None and top_ids is not None:
            top = list(zip(top_ids[i].tolist(), top_values[i].tolist()))
        out.append(TokenLogprob(token_id=token_id, logprob=chosen_list[i], rank=int(ranks_list[i]), top=top))
    return out


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Turns one logits row per draw into a token (and its logprobs when asked)."""

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec]) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs: torch.Tensor | None = None
        if any(s.sampling.logprobs is not None for s in specs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = logits.clone()
        apply_penalties(processed, specs)
        mask_stop_tokens_before_min(processed, specs)

        greedy = torch.argmax(processed, dim=-1).tolist()
        token_ids = [
            int(greedy[i]) if spec.sampling.greedy else random_draw(processed[i], spec)
            for i, spec in enumerate(specs)
        ]
        logprobs: list[TokenLogprob | None] = [None] * len(specs)
        if raw_logprobs is not None:
            for i, spec in enumerate(specs):
                if spec.sampling.logprobs is not None:
                    logprobs[i] = token_logprobs(raw_logprobs[i : i + 1], [token_ids[i]], spec.sampling.logprobs)[0]
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
