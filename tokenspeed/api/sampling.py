"""Request bodies → `SamplingParams`.

OpenAI's defaults apply where the body is silent (temperature 1, top_p 1).
Chat requests without `max_tokens` may use the rest of the context window,
which the scheduler caps for us; a `max_tokens` that does not fit beside the
prompt is a 400 at admission (`scheduler/admission.py`), as with vLLM and
OpenAI. `SamplingParams` itself validates ranges, so a bad value raises
`InvalidRequest` (a 400) there.
"""

from __future__ import annotations

from typing import Any

from tokenspeed.api.protocol import anthropic, openai
from tokenspeed.errors import InvalidRequest
from tokenspeed.scheduler.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _common(body: openai.SamplingFields) -> dict[str, Any]:
    if body.logit_bias:
        raise InvalidRequest("logit_bias is not supported.")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed with stream=true.")
    if body.prompt_logprobs is not None:
        if body.prompt_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.prompt_logprobs}.")
        if body.stream:
            raise InvalidRequest("prompt_logprobs is not available with stream=true.")
    return {
        "n": body.n,
        "temperature": _or(body.temperature, 1.0),
        "top_p": _or(body.top_p, 1.0),
        "top_k": _or(body.top_k, 0),
        "min_p": _or(body.min_p, 0.0),
        "presence_penalty": _or(body.presence_penalty, 0.0),
        "frequency_penalty": _or(body.frequency_penalty, 0.0),
        "repetition_penalty": _or(body.repetition_penalty, 1.0),
        "seed": body.seed,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "prompt_logprobs": body.prompt_logprobs,
    }


def chat_params(body: openai.ChatCompletionRequest) -> SamplingParams:
    logprobs = None
    if body.logprobs:
        logprobs = _or(body.top_logprobs, 0)
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}.")
    elif body.top_logprobs is not None:
        raise InvalidRequest("top_logprobs needs logprobs=true.")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return SamplingParams(**_common(body), max_tokens=max_tokens, logprobs=logprobs)


def completion_params(body: openai.CompletionRequest) -> SamplingParams:
    if body.suffix:
        raise InvalidRequest("suffix is not supported.")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequest("best_of must equal n (sampling extra candidates is not supported).")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.logprobs}.")
    common = _common(body)
    if body.echo and body.logprobs is not None:  # the echoed prompt's tokens come with logprobs too
        common["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
    return SamplingParams(**common, max_tokens=body.max_tokens, logprobs=body.logprobs)


def messages_params(body: anthropic.MessagesRequest) -> SamplingParams:
    return SamplingParams(
        temperature=_or(body.temperature, 1.0),
        top_p=_or(body.top_p, 1.0),
        top_k=_or(body.top_k, 0),
        stop=body.stop_sequences,
        max_tokens=body.max_tokens,
    )
