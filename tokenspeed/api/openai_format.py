"""Pieces of OpenAI response bodies shared by the completions and chat routes: usage, logprobs, ids."""

from __future__ import annotations

import math
import uuid
from typing import Any

from tokenspeed.engine.outputs import Logprob, PositionLogprobs

_UNKNOWN_LOGPROB = -9999.0  # OpenAI's stand-in for "too unlikely to report" (JSON has no -inf)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TokenText:
    """Token id → text for logprob entries (the engine's decoded piece when it sent one)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int, entry: Logprob | None) -> str:
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        text: str = self.tokenizer.decode([token_id])
        return text


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token the sampler ruled out is reported as OpenAI's stand-in."""
    return logprob if math.isfinite(logprob) else _UNKNOWN_LOGPROB


def _ranked(position: PositionLogprobs, top_n: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return ranked[:top_n]


def chat_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], top_n: int, text: TokenText
) -> list[dict[str, Any]]:
    entries = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        token = text(token_id, chosen)
        entries.append(
            {
                "token": token,
                "logprob": _finite(chosen.logprob) if chosen is not None else _UNKNOWN_LOGPROB,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": (t := text(tid, lp)), "logprob": _finite(lp.logprob), "bytes": list(t.encode())}
                    for tid, lp in _ranked(position, top_n)
                ],
            }
        )
    return entries


def completion_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs | None], top_n: int, text: TokenText, offset: int
) -> dict[str, Any]:
    """The legacy shape; `offset` is where this piece's text starts in the choice's text. A position without
    logprobs (the prompt's first token, when echoed) has `null`s, as OpenAI returns it."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position is not None else None
        token = text(token_id, chosen)
        tokens.append(token)
        token_logprobs.append(_finite(chosen.logprob) if chosen is not None else None)
        ranked = _ranked(position, top_n) if position is not None and top_n else None
        top.append({text(tid, lp): _finite(lp.logprob) for tid, lp in ranked} if ranked is not None else None)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs records of consecutive pieces as one (an echoed prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs_json(
    prompt_token_ids: list[int], positions: list[PositionLogprobs | None] | None, top_n: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, its own and the `top_n` likeliest tokens by id (`null` for
    the first token, which has no context)."""
    if positions is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, position in zip(prompt_token_ids, positions):
        if position is None:
            out.append(None)
            continue
        chosen = [(token_id, position[token_id])] if token_id in position else []
        out.append({str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for tid, lp in [*chosen, *_ranked(position, top_n)]})
    return out
