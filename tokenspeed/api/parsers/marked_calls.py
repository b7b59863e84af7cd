"""Calls each wrapped in special markers, with JSON arguments (DeepSeek-V3, Kimi-K2).

    CALL_START header SEPARATOR preamble {json arguments} CALL_END   (whitespace between calls)

The format reads the header and the preamble (the text between the
separator and the arguments' opening brace) into a name and, when the model
writes one, a call id; the arguments stream through `JsonArguments` (a call is
announced once its arguments have begun well-formed).
"""

from __future__ import annotations

from collections.abc import Callable

from tokenspeed.api.parsers.events import ParsedEvent, ToolCallStart
from tokenspeed.api.parsers.json_stream import JsonArguments
from tokenspeed.api.parsers.reading import HEADER_LIMIT, Cursor

ReadHeader = Callable[[str, str], tuple[str, str | None] | None]  # (header, preamble) -> (name, call id)

_BETWEEN, _HEADER, _PREAMBLE, _ARGUMENTS, _TAIL, _OVER = range(6)


class MarkedCallsReader:
    def __init__(self, call_start: str, separator: str, call_end: str, read_header: ReadHeader) -> None:
        self._call_start = call_start
        self._separator = separator
        self._call_end = call_end
        self._read_header = read_header
        self._cursor = Cursor()
        self._state = _BETWEEN
        self._header = ""
        self._arguments = JsonArguments(list)

    def feed(self, text: str) -> list[ParsedEvent]:
        self._cursor.add(text)
        events: list[ParsedEvent] = []
        while self._state != _OVER and self._step(events):
            pass
        return events

    def close(self) -> list[ParsedEvent]:
        return []

    def _step(self, events: list[ParsedEvent]) -> bool:
        cursor = self._cursor
        if self._state == _BETWEEN:
            opened = cursor.opens_with(self._call_start)
            if opened is None:
                return False
            self._state = _HEADER if opened else _OVER
            return True
        if self._state == _HEADER:
            header = cursor.until(self._separator, HEADER_LIMIT)
            if header is None:
                if cursor.gave_up(self._separator, HEADER_LIMIT):
                    self._state = _OVER
                return False
            self._header, self._state = header, _PREAMBLE
            return True
        if self._state == _PREAMBLE:
            brace = cursor.text.find("{", 0, HEADER_LIMIT)
            if brace == -1:
                if len(cursor.text) >= HEADER_LIMIT:
                    self._state = _OVER
                return False
            read = self._read_header(self._header, cursor.consume(brace))
            if read is None:
                self._state = _OVER
                return False
            self._arguments, self._state = JsonArguments(lambda: [ToolCallStart(*read)]), _ARGUMENTS
            return True
        if self._state == _ARGUMENTS:
            complete = self._arguments.read(cursor, events)
            if complete is not None:
                self._state = _TAIL if complete else _OVER
            return bool(complete)
        if self._state == _TAIL:  # e.g. DeepSeek-V3's closing fence
            if cursor.until(self._call_end) is None:
                return False
            self._state = _BETWEEN
            return True
        return False
