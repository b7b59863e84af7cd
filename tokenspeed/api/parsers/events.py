"""What the output parsers emit: an ordered stream of typed pieces of one completion.

A model writes reasoning, answer text and tool calls into one token stream.
The parsers cut that stream into `TextPiece("reasoning" | "content")`,
`ToolCallStart` (a call's name is known) and `ToolCallArguments` (the next
fragment of that call's arguments) in the order they were written, so the
OpenAI routes can stream `tool_calls` deltas as OpenAI does (first the id and
name, then argument fragments), the Anthropic route can stream `tool_use`
blocks with `input_json_delta`s, and the Responses route `function_call`
items. Non-streaming parsing is streaming parsing of the whole text at once,
and the parsers decide only on what the text so far says (never on where a
delta ended), so both modes agree by construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal, Protocol

TextKind = Literal["reasoning", "content"]


@dataclass(slots=True)
class TextPiece:
    kind: TextKind
    text: str


@dataclass(slots=True)
class ToolCallStart:
    """A call begins; the arguments follow as `ToolCallArguments`."""

    name: str
    call_id: str | None = None  # the model's own id (Kimi-K2, Mistral); None: the route makes one


@dataclass(slots=True)
class ToolCallArguments:
    """The next fragment of the arguments of the call started last (canonical JSON, see json_stream.py)."""

    text: str


ParsedEvent = TextPiece | ToolCallStart | ToolCallArguments


class ParserStage(Protocol):
    """Reads one completion's text as it arrives into events: a reasoning splitter or a tool-call stream."""

    def feed(self, text: str) -> list[ParsedEvent]: ...

    def finish(self) -> list[ParsedEvent]: ...


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialised canonically (see canonical_json)
    call_id: str | None = None

    @property
    def complete(self) -> bool:
        """Do the arguments form a JSON object? Not when the output was cut off (or went wrong) inside them."""
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False


@dataclass(slots=True)
class ParsedOutput:
    """All events of a finished completion, folded the way OpenAI's message shape wants them."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def fold(cls, events: list[ParsedEvent]) -> ParsedOutput:
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        for event in events:
            if isinstance(event, ToolCallStart):
                calls.append(ToolCall(event.name, "", event.call_id))
            elif isinstance(event, ToolCallArguments):
                calls[-1].arguments += event.text
            elif event.kind == "reasoning":
                reasoning.append(event.text)
            else:
                content.append(event.text)
        return cls("".join(reasoning) if reasoning else None, "".join(content) if content else None, calls)


def whole_call(call: ToolCall) -> list[ParsedEvent]:
    """A call known all at once, as events."""
    return [ToolCallStart(call.name, call.call_id), ToolCallArguments(call.arguments)]


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with.

    That many characters must be held back: the next delta may complete the marker.
    """
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
