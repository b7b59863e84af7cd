"""Anthropic Messages request bodies: `/v1/messages` and `/v1/messages/count_tokens`.

Shaped after Anthropic's API reference so Claude Code and the official SDK
work unchanged. Content blocks are typed by `type`; image and document
blocks parse (clients send them) but templating rejects them with a 400,
since the engine serves text-only models. Unknown fields are tolerated.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenspeed.api.protocol.strict import Body as _Body
from tokenspeed.api.protocol.strict import Count, PositiveCount, RequestBody, TopK


class Block(_Body):
    """One content block. Which fields matter depends on `type`; `templating.py` checks them."""

    type: str
    text: str | None = None
    # thinking
    thinking: str | None = None
    signature: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Count | None = None


class CountTokensRequest(RequestBody):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: PositiveCount
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    metadata: dict[str, Any] | None = None
