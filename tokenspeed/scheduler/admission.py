"""`check_admission`: the one rule for whether a request may enter the engine.

Every front end (the API server's `AsyncEngine`, the offline `LLM`, the
engine core itself) calls this one function with the limits the core
reported at start-up, so a request is refused for the same reasons, with the
same message, wherever it comes in. The front ends call it before anything
is sent, so a bad request costs the core nothing and the server can answer
4xx before it opens a stream; the scheduler calls it again on `submit`
because it is the last line of defence for anything that reaches the core.

Token ids from the client (the prompt's, `stop_token_ids`, `logit_bias`'s) are checked
against the vocabulary here: an id outside it would index past the logits
row in the sampler and take the whole engine down with it.

Pure Python, no torch: the scheduler imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenspeed.errors import ContextTooLong, InvalidRequest
from tokenspeed.scheduler.sampling_params import SamplingParams

_SHOWN = 5  # bad ids quoted in a message


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """What the engine can hold, as the core reports it once its model and KV pool exist."""

    max_model_len: int
    max_num_seqs: int
    page_size: int
    num_kv_pages: int
    vocab_size: int | None = None  # None: token ids are not range-checked (scheduler-only tests)
    # Front ends refuse a max_tokens that cannot fit beside the prompt; the scheduler itself clamps it
    # (the ending at the context limit is part of what its model checkers explore).
    refuse_overlong_max_tokens: bool = True


def _out_of_vocab(ids: Sequence[object], vocab_size: int) -> list[object]:
    return [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]


def _quote(bad: list[object]) -> str:
    return f"{bad[:_SHOWN]}" + (" ..." if len(bad) > _SHOWN else "")


def pages_needed(num_prompt_tokens: int, page_size: int) -> int:
    """KV pages a prompt needs at once. The same for n > 1: each of the n children (engine/fan_out.py)
    is admitted on its own, sharing the full prompt pages of the others through the prefix cache."""
    return -(-num_prompt_tokens // page_size)


def check_admission(prompt_token_ids: Sequence[int], params: SamplingParams, limits: AdmissionLimits) -> None:
    """Raise `InvalidRequest` / `ContextTooLong` (HTTP 400) if this request can never be served."""
    num_prompt = len(prompt_token_ids)
    if not num_prompt:
        raise InvalidRequest("The prompt is empty: it must contain at least one token.")
    if num_prompt >= limits.max_model_len:
        raise ContextTooLong(
            f"The prompt has {num_prompt} tokens but max_model_len is {limits.max_model_len} (this model's "
            f"maximum context length is {limits.max_model_len} tokens); it must be shorter to leave room for "
            f"at least one output token."
        )
    max_tokens = params.max_tokens
    if max_tokens is not None and num_prompt + max_tokens > limits.max_model_len and limits.refuse_overlong_max_tokens:
        # Refused rather than clamped, as vLLM and OpenAI do: a silent clamp ends in a surprising
        # finish_reason "length". Without max_tokens a request may use the rest of the window.
        raise ContextTooLong(
            f"max_tokens={max_tokens} with a {num_prompt}-token prompt needs "
            f"{num_prompt + max_tokens} tokens, but max_model_len is {limits.max_model_len}; "
            f"ask for at most {limits.max_model_len - num_prompt} new tokens, or leave max_tokens unset."
        )
    if limits.vocab_size is not None:
        bad = _out_of_vocab(prompt_token_ids, limits.vocab_size)
        if bad:
            raise InvalidRequest(f"Prompt token ids must be integers in [0, {limits.vocab_size}); got {_quote(bad)}")
        bad = _out_of_vocab(params.stop_token_ids or [], limits.vocab_size)
        if bad:
            raise InvalidRequest(f"stop_token_ids must be integers in [0, {limits.vocab_size}); got {_quote(bad)}")
        bad = _out_of_vocab(list(params.logit_bias or ()), limits.vocab_size)
        if bad:
            raise InvalidRequest(f"logit_bias token ids must be in [0, {limits.vocab_size}); got {_quote(bad)}")
    if params.n > limits.max_num_seqs:
        raise InvalidRequest(f"n={params.n} exceeds max_num_seqs={limits.max_num_seqs}.")
    pages = pages_needed(num_prompt, limits.page_size)
    if pages > limits.num_kv_pages:
        raise ContextTooLong(
            f"A {num_prompt}-token prompt needs {pages} KV pages; the engine has {limits.num_kv_pages}."
        )
