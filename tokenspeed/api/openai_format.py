"""Pieces of OpenAI response bodies shared by the completions and chat routes: usage, logprobs, ids."""

from __future__ import annotations

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
                "logprob": chosen.logprob if chosen is not None else _UNKNOWN_LOGPROB,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": (t := text(tid, lp)), "logprob": lp.logprob, "bytes": list(t.encode())}
                    for tid, lp in _ranked(position, top_n)
                ],
            }
        )
    return entries


def completion_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], top_n: int, text: TokenText, offset: int
) -> dict[str, Any]:
    """The legacy shape; `offset` is where this piece's text starts in the choice's text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id)
        token = text(token_id, chosen)
        tokens.append(token)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        top.append({text(tid, lp): lp.logprob for tid, lp in _ranked(position, top_n)} if top_n else None)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
