"""`OutputParser`: reasoning split, then tool-call extraction, for one completion.

Reasoning comes first in the output, so the reasoning parser sees the raw
text and only its answer part goes on to the tool parser (a `<tool_call>`
quoted inside the reasoning is not a call). When the route forced the start
of a call into the prompt, that opening is fed first, as if the model had
written it, and reasoning parsing is off: the output begins inside a call.
Harmony (`openai`) carries reasoning, answer and calls in one syntax, so it
is one stage doing both.
"""

from __future__ import annotations

from tokenspeed.api.parsers.events import ParsedEvent, ParsedOutput, ParserStage, TextPiece
from tokenspeed.api.parsers.reading import ToolSchemas
from tokenspeed.api.parsers.reasoning import reasoning_stream
from tokenspeed.api.parsers.registry import ToolFormat


class OutputParser:
    def __init__(
        self,
        *,
        reasoning_parser: str | None = None,
        tool_format: ToolFormat | None = None,
        forced_prefix: str = "",
        tools: ToolSchemas | None = None,
        thinking: bool = True,
    ) -> None:
        self._reasoning: ParserStage | None = None
        self._tools: ParserStage | None = None
        if tool_format is not None and tool_format.reads_reasoning:
            self._reasoning = tool_format.stream(tools or {})
        else:
            if reasoning_parser is not None and not forced_prefix:
                self._reasoning = reasoning_stream(reasoning_parser, thinking)
            if tool_format is not None:
                self._tools = tool_format.stream(tools or {})
        self._pending_prefix = forced_prefix

    def feed(self, text: str) -> list[ParsedEvent]:
        if self._pending_prefix:
            text, self._pending_prefix = self._pending_prefix + text, ""
        if self._reasoning is None:
            return self._to_tools([TextPiece("content", text)] if text else [])
        return self._to_tools(self._reasoning.feed(text))

    def finish(self) -> list[ParsedEvent]:
        events = self.feed("") if self._pending_prefix else []
        pieces = self._reasoning.finish() if self._reasoning is not None else []
        events.extend(self._to_tools(pieces))
        if self._tools is not None:
            events.extend(self._tools.finish())
        return events

    def parse(self, text: str) -> ParsedOutput:
        """The whole output at once (non-streaming): exactly what streaming would have produced."""
        return ParsedOutput.fold(self.feed(text) + self.finish())

    def _to_tools(self, pieces: list[ParsedEvent]) -> list[ParsedEvent]:
        if self._tools is None:
            return list(pieces)
        events: list[ParsedEvent] = []
        for piece in pieces:
            if isinstance(piece, TextPiece) and piece.kind == "content":
                events.extend(self._tools.feed(piece.text))
            else:
                events.append(piece)
        return events
