"""Held-out metrics with plain torch: bits per byte, top-1, next-next-token accuracy of the draft heads.

Windows come from `corpus.eval_windows`: in each, position 0 is context
only and every later token is scored given the tokens before it in the
window. Bits per byte = total negative log-likelihood (nats) / ln 2 / the
UTF-8 bytes of the scored tokens. Top-1 counts a position when no token has
a strictly higher log-probability than the true one, which is the engine's
`rank == 1`, so both sides count the same positions.

Next-next-token accuracy (draft heads): at position p the head sees the
target's hidden state at p and the true token t_{p+1} and predicts t_{p+2}.
`top1` compares its argmax with the held-out text; `agreement` with the
target's own argmax at p+1, the token greedy verification would accept.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

HiddenFn = Callable[[torch.Tensor], torch.Tensor]


def _batches(windows: np.ndarray, batch_size: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.from_numpy(windows[i : i + batch_size]).to(device) for i in range(0, len(windows), batch_size)]


def _rank_one(logprobs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = logprobs.gather(-1, targets.unsqueeze(-1))
    return chosen.squeeze(-1), (logprobs > chosen).sum(-1) == 0


def score_positions(logits: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor) -> dict[str, float]:
    """Sums over positions: nats, bytes, top-1 hits, count (from logits `[..., vocab]` and their targets)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen, top1 = _rank_one(logprobs, targets)
    return {
        "nats": float(-chosen.double().sum()),
        "bytes": float(token_bytes[targets].sum()),
        "hits": float(top1.sum()),
        "count": float(targets.numel()),
    }


def summarise(totals: dict[str, float]) -> dict[str, float]:
    return {
        "bits_per_byte": totals["nats"] / math.log(2) / max(totals["bytes"], 1.0),
        "nats_per_token": totals["nats"] / max(totals["count"], 1.0),
        "top1": totals["hits"] / max(totals["count"], 1.0),
        "tokens": totals["count"],
        "bytes": totals["bytes"],
    }


@torch.no_grad()
def language_model_metrics(
    hidden_fn: HiddenFn,
    head_weight: torch.Tensor,
    windows: np.ndarray,
    token_bytes: np.ndarray,
    *,
    batch_size: int = 16,
) -> dict[str, float]:
    """Held-out bits per byte and top-1 of a model given as (final hidden states fn, LM head weight)."""
    device = head_weight.device
    bytes_of = torch.from_numpy(token_bytes).to(device)
    totals = {"nats": 0.0, "bytes": 0.0, "hits": 0.0, "count": 0.0}
    for ids in _batches(windows, batch_size, device):
        hidden = hidden_fn(ids)[:, :-1]
        for key, value in score_positions(F.linear(hidden, head_weight), ids[:, 1:], bytes_of).items():
            totals[key] += value
    return summarise(totals)


@torch.no_grad()
def next_next_metrics(
    hidden_fn: HiddenFn,
    draft_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    head_weight: torch.Tensor,
    windows: np.ndarray,
    *,
    batch_size: int = 16,
) -> dict[str, float]:
    """Top-1 of a draft head's t_{p+2} prediction against the text and against the target's argmax.

    `draft_fn(hidden[:, :-1], ids[:, 1:])` returns the head's hidden states
    whose LM-head logits predict t_{p+2}, for positions p = 0 .. len - 2.
    """
    device = head_weight.device
    hits = agree = count = 0.0
    for ids in _batches(windows, batch_size, device):
        hidden = hidden_fn(ids)
        draft = F.linear(draft_fn(hidden[:, :-1], ids[:, 1:])[:, :-1], head_weight).float()
        target_next = F.linear(hidden[:, 1:-1], head_weight).float().argmax(-1)  # the target's t_{p+2}
        truth = ids[:, 2:]
        _, top1 = _rank_one(draft.log_softmax(-1), truth)
        hits += float(top1.sum())
        agree += float((draft.argmax(-1) == target_next).sum())
        count += truth.numel()
    return {"top1": hits / max(count, 1.0), "agreement": agree / max(count, 1.0), "tokens": count}
