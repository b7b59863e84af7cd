"""Request bodies → `SamplingParams`.

OpenAI's defaults apply where the body is silent (temperature 1, top_p 1).
Structured output comes from whichever one of `response_format`
(`json_object`, `json_schema`), vLLM's `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` or `structured_outputs` the body sets
(two at once is a 400), and `logit_bias` passes through with its token ids
as integers; `SamplingParams` checks both.
Chat requests without `max_tokens` may use the rest of the context window,
which the scheduler caps for us; a `max_tokens` that does not fit beside the
prompt is a 400 at admission (`scheduler/admission.py`), as with vLLM and
OpenAI. `SamplingParams` itself validates ranges, so a bad value raises
`InvalidRequest` (a 400) there.
"""

from __future__ import annotations

from typing import Any

from tokenspeed.api.cache_session import anthropic_session, openai_session
from tokenspeed.api.protocol import anthropic, openai
from tokenspeed.errors import InvalidRequest
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.structured_outputs import StructuredOutputsParams

MAX_TOP_LOGPROBS = 20


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def response_format_params(kind: str, schema: dict[str, Any] | None, where: str) -> StructuredOutputsParams | None:
    """OpenAI's response format (`text`, `json_object`, `json_schema` with `schema`) as a grammar."""
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        if schema is None:
            raise InvalidRequest(f"{where} json_schema needs a schema.")
        return StructuredOutputsParams(json=schema)
    raise InvalidRequest(f"{where} type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'.")


def structured_outputs_of(body: openai.SamplingFields) -> StructuredOutputsParams | None:
    """The one grammar the body asks for, under any of its names (None: free text)."""
    if body.guided_whitespace_pattern is not None:
        raise InvalidRequest("guided_whitespace_pattern is not supported: JSON is generated in one fixed layout.")
    given: list[tuple[str, StructuredOutputsParams]] = []
    if body.response_format is not None:
        fmt = body.response_format
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        spec = response_format_params(fmt.type, schema, "response_format")
        if spec is not None:
            given.append(("response_format", spec))
    for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            given.append((name, StructuredOutputsParams(**{field: value})))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", StructuredOutputsParams.coerce(body.structured_outputs)))
    if len(given) > 1:
        raise InvalidRequest(f"Set one structured output, not {' and '.join(name for name, _ in given)}.")
    return given[0][1] if given else None


def _common(body: openai.SamplingFields) -> dict[str, Any]:
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed with stream=true.")
    if body.prompt_logprobs is not None:
        if body.prompt_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.prompt_logprobs}.")
        if body.stream:
            raise InvalidRequest("prompt_logprobs is not available with stream=true.")
    session, ttl = openai_session(body)
    return {
        "cache_session": session,
        "cache_ttl": ttl,
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
        "logit_bias": body.logit_bias or None,
        "structured_outputs": structured_outputs_of(body),
    }


def chat_params(body: openai.ChatCompletionRequest, tool_grammar: StructuredOutputsParams | None = None) -> SamplingParams:
    """`tool_grammar`: the grammar enforcing a required/named tool call (`tool_policy.py`)."""
    logprobs = None
    if body.logprobs:
        logprobs = _or(body.top_logprobs, 0)
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}.")
    elif body.top_logprobs is not None:
        raise InvalidRequest("top_logprobs needs logprobs=true.")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    common = _common(body)
    if tool_grammar is not None:
        if common["structured_outputs"] is not None:
            raise InvalidRequest("A forced tool call and a structured output cannot be asked for together.")
        common["structured_outputs"] = tool_grammar
    return SamplingParams(**common, max_tokens=max_tokens, logprobs=logprobs)


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


def messages_params(
    body: anthropic.MessagesRequest, tool_grammar: StructuredOutputsParams | None = None
) -> SamplingParams:
    """`tool_grammar`: the grammar enforcing `tool_choice` any/tool over the tools' input schemas."""
    session, ttl = anthropic_session(body)
    return SamplingParams(
        cache_session=session,
        cache_ttl=ttl,
        temperature=_or(body.temperature, 1.0),
        top_p=_or(body.top_p, 1.0),
        top_k=_or(body.top_k, 0),
        stop=body.stop_sequences,
        max_tokens=body.max_tokens,
        structured_outputs=tool_grammar,
    )
