"""OpenAI Responses request body: `POST /v1/responses`.

Shaped after OpenAI's API reference so the official SDK's
`client.responses.create(...)` (and Codex-style agents) work unchanged.
`input` is a string or a list of items; an item is typed by `type` (a bare
`{"role", "content"}` is a message) and `responses_input.py` checks the
fields each type needs, with a 400 naming the item. Function tools are
served; built-in tools (web search, file search, ...) are refused with a
400. Unknown fields are tolerated, as elsewhere.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from tokenspeed.api.protocol.strict import Body as _Body
from tokenspeed.api.protocol.strict import PositiveCount, RequestBody

MAX_METADATA_PAIRS = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

MetadataKey = Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY)]
MetadataValue = Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)]


class ContentPart(_Body):
    """A part of a message (`input_text`, `output_text`, ...) or of a reasoning item (`reasoning_text`)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(_Body):
    type: str = "message"
    id: str | None = None
    status: str | None = None
    # message
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    # function_call, function_call_output
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    # reasoning
    summary: list[ContentPart] | None = None
    encrypted_content: str | None = None


class Tool(_Body):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "name", "schema", "strict"}`."""

    type: str
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: PositiveCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    logit_bias: dict[str, float] | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    text: TextConfig | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=MAX_METADATA_PAIRS)
    user: str | None = None
