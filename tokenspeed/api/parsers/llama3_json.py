"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is the call(s), with no surrounding markers.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Meta's model card for JSON-based tool calling describes this form; the
model may open it with `<|python_tag|>` (dropped when special tokens are
skipped) and Llama 3.2 separates several calls with `; `. So the answer is
read as calls when, after leading whitespace, it begins with `{` or
`<|python_tag|>`; if no call can be read from it, it is given back as
ordinary content, verbatim.
"""

from __future__ import annotations

from tokenspeed.api.canonical_json import canonical_json
from tokenspeed.api.parsers.events import ParsedEvent, TextPiece, ToolCallStart
from tokenspeed.api.parsers.json_calls import JsonCallsReader
from tokenspeed.api.parsers.reading import ToolSchemas

PYTHON_TAG = "<|python_tag|>"

_DECIDING, _TEXT, _CALLS = range(3)


class WholeOutputCalls:
    def __init__(self) -> None:
        self._state = _DECIDING
        self._raw = ""  # the output so far, while it may still be given back as text
        self._reader = JsonCallsReader()
        self._called = False

    def feed(self, text: str) -> list[ParsedEvent]:
        if self._state == _TEXT:
            return [TextPiece("content", text)] if text else []
        self._raw += text
        if self._state == _DECIDING:
            head = self._raw.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return []
            if not (head.startswith("{") or head.startswith(PYTHON_TAG)):
                self._state = _TEXT
                return [TextPiece("content", self._raw)]
            self._state = _CALLS
            text = head.removeprefix(PYTHON_TAG)
        return self._calls(self._reader.feed(text))

    def finish(self) -> list[ParsedEvent]:
        if self._state == _CALLS:
            events = self._calls(self._reader.close())
            return events if self._called else [TextPiece("content", self._raw)]
        if self._state == _DECIDING and self._raw:
            return [TextPiece("content", self._raw)]
        return []

    def _calls(self, events: list[ParsedEvent]) -> list[ParsedEvent]:
        self._called = self._called or any(isinstance(e, ToolCallStart) for e in events)
        return events


def stream(tools: ToolSchemas) -> WholeOutputCalls:
    return WholeOutputCalls()


def forced_prefix(name: str | None) -> str:
    return '{"name": "' if name is None else '{"name": ' + canonical_json(name) + ', "parameters": '
