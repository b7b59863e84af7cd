"""Verification: which drafted tokens a request emits, exactly as if it had decoded one by one.

A verify row runs the target model over [last token, d1 .. dk] and gets
logits at k+1 positions: position i scores the token after d1 .. di. What is
emitted is decided here, on tensors (all rows at once, no host round trip),
in one of three ways; each returns `Verified`: per row the emitted tokens
(the accepted drafts, then one token of the model's) and their number, 1 .. k+1.

* Greedy rows: the model's argmax at each position; drafts are accepted while
  they equal it (`verify_greedy`). The output is plain greedy decoding's.

* Sampled rows, drafts from a deterministic drafter (n-gram, suffix: a point
  mass q = 1 on the draft): the non-speculative sampler draws the token at
  each position i with its own key (seed, sample_index + i) and drafts are
  accepted while they equal the draw (`verify_point_mass`). This IS rejection
  sampling for a point mass: the draft is accepted with probability p(d) =
  min(1, p(d)/q(d)), and when it is not the draw is distributed as p without
  d, renormalised = norm(max(0, p - q)). It is also token-for-token the
  non-speculative output (same keys, same sampler), so seeded requests give
  the same tokens with speculation on or off, whatever was drafted.

* Drafts sampled from a model with probabilities q (EAGLE, MTP, a draft
  model at temperature > 0): accept d with probability min(1, p(d)/q(d)),
  else draw from norm(max(0, p - q)); after k accepted drafts, draw the bonus
  token from p (`rejection_sample`). The emitted tokens have exactly the
  target distribution (Leviathan et al. 2023, Chen et al. 2023), but not the
  non-speculative tokens. Its randomness is keyed like the sampler's: the
  acceptance uniform and the residual draw of position i come from
  (seed, sample_index + i) through separate streams of splitmix64
  (`kernels/sampling/keys.py`), computed on the device, so a verify batch
  needs no generator state and can run inside a CUDA graph. The drafter must
  draw its drafts from a stream of its own (`DRAFT_STREAM`).

Target probabilities respect temperature, min-p, top-k and top-p as the
non-speculative sampler applies them (`filtered_probs`, equal to
`kernels/sampling/reference.filter_probs_reference` row by row, normalised).
Penalties and the min-tokens stop mask are the caller's: position i's logits
must be processed with the history plus d1 .. di, as the sampler would have
seen it had those tokens been emitted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed.kernels.sampling.keys import mix_seeds
from tokenspeed.kernels.sampling.reference import sample_reference
from tokenspeed.scheduler.sampling_params import GREEDY_EPSILON

ACCEPT_STREAM = 0x5EC0_0001  # the acceptance uniforms of rejection sampling
RESIDUAL_STREAM = 0x5EC0_0002  # its draws from the residual (and the bonus token)
DRAFT_STREAM = 0x5EC0_0003  # for drafters that sample: independent of the two above

Sampler = Callable[..., torch.Tensor]  # sample_reference's signature: (logits, temperature, top_k, ...)


@dataclass(slots=True)
class Verified:
    token_ids: torch.Tensor  # [rows, k+1] int64: emitted tokens, -1 past num_emitted
    num_emitted: torch.Tensor  # [rows] int64, 1 .. num_draft_tokens + 1

    def rows(self) -> list[list[int]]:
        """Emitted tokens per row, on the host (the executor's one synchronisation)."""
        counts = self.num_emitted.tolist()
        return [row[:n] for row, n in zip(self.token_ids.tolist(), counts)]


def accept_drafts(target_token_ids: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_draft_tokens: torch.Tensor) -> Verified:
    """Accept drafts while they equal the target's token at their position; then the target's token.

    `target_token_ids` [rows, k+1]: the token the target emits at each position given the drafts
    before it; `draft_token_ids` [rows, k] (padding past `num_draft_tokens` [rows] is ignored).
    """
    rows, width = draft_token_ids.shape
    positions = torch.arange(width, device=draft_token_ids.device)
    match = (target_token_ids[:, :width] == draft_token_ids) & (positions < num_draft_tokens[:, None])
    accepted = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)
    num_emitted = accepted + 1
    keep = torch.arange(width + 1, device=draft_token_ids.device) < num_emitted[:, None]
    tokens = torch.where(keep, target_token_ids.to(torch.int64), torch.full_like(target_token_ids, -1,
                                                                                 dtype=torch.int64))
    return Verified(tokens, num_emitted)


def verify_greedy(logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor) -> Verified:
    """`logits` [rows, k+1, vocab]: greedy acceptance (the longest prefix equal to the argmaxes)."""
    return accept_drafts(torch.argmax(logits, dim=-1), draft_token_ids, num_draft_tokens)


def verify_point_mass(
    logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
    sample: Sampler = sample_reference,
) -> Verified:
    """Deterministic drafts, any temperature (greedy rows included): draw each position's token with
    the non-speculative `sample` keyed by (seed, sample_index + i), accept drafts while equal.

    `logits` [rows, k+1, vocab]; per-row parameters [rows]. `sample` takes flat `[n, vocab]` logits and
    `[n]` parameters, like `kernels/sampling` (the reference on the CPU, the Triton kernel on a GPU).
    """
    rows, width, vocab = logits.shape
    offsets = torch.arange(width, device=logits.device)

    def per_position(values: torch.Tensor) -> torch.Tensor:
        return values[:, None].expand(rows, width).reshape(-1)

    drawn = sample(
        logits.reshape(rows * width, vocab),
        per_position(temperature),
        per_position(top_k),
        per_position(top_p),
        per_position(min_p),
        per_position(seeds),
        (sample_indices[:, None] + offsets).reshape(-1),
    )
    return accept_drafts(drawn.reshape(rows, width), draft_token_ids, num_draft_tokens)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """The distribution the sampler draws from, normalised: softmax(logits / T), then min-p, top-k, top-p.

    `logits` [n, vocab], parameters [n]. Rows with temperature below the greedy threshold get a point
    mass on their first argmax (what greedy sampling emits).
    """
    logits = logits.float()
    greedy = temperature < GREEDY_EPSILON
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    probs = torch.softmax(logits / scale[:, None], dim=-1)
    zero = torch.zeros_like(probs)
    # min-p: drop what is below min_p times the row's maximum.
    probs = torch.where(probs < min_p[:, None].float() * probs.max(dim=-1, keepdim=True).values, zero, probs)
    # top-k: drop what is below the k-th largest (ties with it stay), for 0 < k < vocab.
    vocab = probs.shape[-1]
    ordered = torch.sort(probs, dim=-1, descending=True).values
    k = top_k.to(torch.int64)
    kth = ordered.gather(1, (k.clamp(1, vocab) - 1)[:, None])
    use_k = ((k > 0) & (k < vocab))[:, None]
    probs = torch.where(use_k & (probs < kth), zero, probs)
    # top-p: keep the smallest prefix, most likely first, whose mass reaches top_p (the first token stays).
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    cumulative = torch.cumsum(ordered, dim=-1)
    drop_sorted = (cumulative - ordered) >= top_p[:, None].float() * cumulative[:, -1:]
    drop_sorted &= (top_p < 1.0)[:, None]
    probs = torch.where(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), zero, probs)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    point = torch.zeros_like(probs).scatter(1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], point, probs)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    seeds: torch.Tensor,
    sample_indices: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> Verified:
    """Rejection sampling: the emitted tokens are distributed as the target's (module docstring).

    `target_probs` [rows, k+1, vocab] (normalised, from `filtered_probs`), `draft_token_ids` [rows, k],
    `draft_probs` [rows, k, vocab] the drafter's distributions the drafts were drawn from (None: a
    deterministic drafter, a point mass on each draft). Keys: (seeds [rows], sample_indices [rows] + i).
    """
    rows, width = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    drafts = draft_token_ids.to(torch.int64)
    p_draft = target_probs[:, :width].gather(2, drafts[..., None]).squeeze(-1).to(torch.float64)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, drafts[..., None]).squeeze(-1).to(torch.float64)
    indices = sample_indices[:, None].to(torch.int64) + torch.arange(width + 1, device=device)
    uniform = keyed_uniform(seeds, indices[:, :width], ACCEPT_STREAM)
    accept = (uniform * q_draft < p_draft) & (torch.arange(width, device=device) < num_draft_tokens[:, None])
    accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # u < p/q, drafts in order
    # One draw per row, at the first position not accepted: from norm(max(0, p - q)) where a draft was
    # rejected, from p for the bonus token after the last draft. Only that position's vocabulary is read.
    spot = accepted[:, None]
    at_spot = spot[..., None].expand(rows, 1, vocab)
    p_spot = target_probs.gather(1, at_spot).to(torch.float64)
    padded = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
    if draft_probs is None:
        residual = p_spot.scatter(2, padded.gather(1, spot)[..., None], 0.0)
    else:
        q_padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
        residual = (p_spot - q_padded.gather(1, at_spot).to(torch.float64)).clamp_min(0.0)
    rejected = (accepted < num_draft_tokens)[:, None, None] & (residual.sum(dim=-1, keepdim=True) > 0)
    weights = torch.where(rejected, residual, p_spot)  # p == q leaves no residual, but then nothing is rejected
    drawn = keyed_categorical(weights, seeds, indices.gather(1, spot), RESIDUAL_STREAM)
    column = torch.arange(width + 1, device=device)[None, :]
    tokens = torch.where(column < spot, padded, torch.where(column == spot, drawn, -1))
    return Verified(tokens, accepted + 1)


def keyed_uniform(seeds: torch.Tensor, indices: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64, one per (seed [rows], index [rows, m]) of `stream`: no generator state."""
    keys = mix_seeds(_stream_seeds(seeds, stream)[:, None].expand_as(indices), indices)
    return _to_uniform(keys)


def keyed_categorical(weights: torch.Tensor, seeds: torch.Tensor, indices: torch.Tensor, stream: int
                      ) -> torch.Tensor:
    """One draw per `weights` [rows, m, vocab] row (proportional to the weights, unnormalised is fine),
    keyed by (seed [rows], index [rows, m]) of `stream`: the exponential race argmax(w / E)."""
    vocab = weights.shape[-1]
    keys = mix_seeds(_stream_seeds(seeds, stream)[:, None].expand_as(indices), indices)
    token_ids = torch.arange(vocab, device=weights.device)
    exponential = -torch.log(_to_uniform(mix_seeds(keys[..., None].expand(*keys.shape, vocab), token_ids)))
    return torch.argmax(weights / exponential, dim=-1)


def _stream_seeds(seeds: torch.Tensor, stream: int) -> torch.Tensor:
    return mix_seeds(seeds.to(torch.int64), torch.full_like(seeds, stream, dtype=torch.int64))


def _to_uniform(keys: torch.Tensor) -> torch.Tensor:
    """63-bit keys -> (0, 1): the top 52 bits, centred in their interval."""
    return ((keys >> 11).to(torch.float64) + 0.5) * (2.0**-52)
