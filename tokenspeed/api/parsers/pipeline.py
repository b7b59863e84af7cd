"""`OutputParser`: reasoning split, then tool-call extraction, for one completion.

Reasoning comes first in the output, so the reasoning parser sees the raw
text and only its answer part goes on to the tool parser (a `<tool_call>`
quoted inside the reasoning is not a call). When the route forced the start
of a call into the prompt, that opening is fed first, as if the model had
written it, and reasoning parsing is off: the output begins inside a call.
"""

from __future__ import annotations

from tokenspeed.api.parsers.events import ParsedEvent, ParsedOutput, TextPiece
from tokenspeed.api.parsers.reasoning import ReasoningStream, reasoning_stream
from tokenspeed.api.parsers.registry import ToolFormat
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream


class OutputParser:
    def __init__(
        self,
        *,
        reasoning_parser: str | None = None,
        tool_format: ToolFormat | None = None,
        forced_prefix: str = "",
    ) -> None:
        self._reasoning: ReasoningStream | None = None
        if reasoning_parser is not None and not forced_prefix:
            self._reasoning = reasoning_stream(reasoning_parser)
        self._tools: ToolBlockStream | None = tool_format.stream() if tool_format is not None else None
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

    def _to_tools(self, pieces: list[TextPiece]) -> list[ParsedEvent]:
        if self._tools is None:
            return list(pieces)
        events: list[ParsedEvent] = []
        for piece in pieces:
            if piece.kind == "content":
                events.extend(self._tools.feed(piece.text))
            else:
                events.append(piece)
        return events
