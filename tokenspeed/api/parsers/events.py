"""What the output parsers emit: an ordered stream of typed pieces of one completion.

A model writes reasoning, answer text and tool calls into one token stream.
The parsers cut that stream into `TextPiece("reasoning" | "content")` and
`ToolCall` events in the order they were written, so the OpenAI routes can fold
them into `reasoning_content` / `content` / `tool_calls`, and the Anthropic
route can turn the same events into ordered content blocks. Non-streaming
parsing is streaming parsing of the whole text at once, so both modes agree
by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

TextKind = Literal["reasoning", "content"]


@dataclass(slots=True)
class TextPiece:
    kind: TextKind
    text: str


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialised canonically (see canonical_json)


ParsedEvent = TextPiece | ToolCall


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
            if isinstance(event, ToolCall):
                calls.append(event)
            elif event.kind == "reasoning":
                reasoning.append(event.text)
            else:
                content.append(event.text)
        return cls("".join(reasoning) if reasoning else None, "".join(content) if content else None, calls)


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with.

    That many characters must be held back: the next delta may complete the marker.
    """
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
