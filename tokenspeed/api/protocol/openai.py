"""OpenAI request bodies: `/v1/completions` and `/v1/chat/completions`.

Field names and defaults follow OpenAI's API reference; vLLM's extensions
that agents and benchmarks rely on (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `chat_template_kwargs`, ...)
are accepted too, so a client that works against vLLM works here. Unknown
fields are tolerated (new OpenAI fields appear often and clients send them
by default); wrong types and values are a 400 (`strict.py` says which).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenspeed.api.protocol.strict import Body as _Body
from tokenspeed.api.protocol.strict import Count, PositiveCount, RequestBody, Seed, TokenId, TopK


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(RequestBody):
    """What both endpoints share; `sampling.py` turns it into `SamplingParams`."""

    model: str | None = None
    n: PositiveCount = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    max_tokens: PositiveCount | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: Count | None = None  # vLLM's: logprobs of the prompt tokens, with this many alternatives
    # Structured output: OpenAI's response_format, vLLM's guided_* extras and their newer structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: xgrammar is the one backend
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # OpenAI's cache key: also the session of KV retention


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: PositiveCount | None = 16
    logprobs: Count | None = None
    echo: bool = False
    best_of: PositiveCount | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ContentPart(_Body):
    """Any part; only text parts are understood (the check is in templating, with a clear 400)."""

    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveCount | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
