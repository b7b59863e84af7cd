"""GLM-4.5 / GLM-4.6 tool calls (their chat template writes them so):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A call is announced when its name line ends; string parameters stream as
they are written, other values once their `</arg_value>` arrives
(`xml_values.py` types them by the tool's schema).
"""

from __future__ import annotations

from tokenspeed.api.parsers.events import ParsedEvent, ToolCallArguments, ToolCallStart
from tokenspeed.api.parsers.reading import HEADER_LIMIT, Cursor, ToolSchemas
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream
from tokenspeed.api.parsers.xml_values import ArgumentsWriter, declared_type, read_value

START = "<tool_call>"
END = "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
MARKERS = (START, END, KEY, KEY_END, VALUE, VALUE_END)

_NAME, _KEYS, _KEY, _VALUE_OPEN, _VALUE, _OVER = range(6)


class GlmCallReader:
    def __init__(self, schemas: ToolSchemas) -> None:
        self._schemas = schemas
        self._cursor = Cursor()
        self._state = _NAME
        self._name = ""
        self._kind: str | None = None  # the declared type of the value being read
        self._arguments = ArgumentsWriter()

    def feed(self, text: str) -> list[ParsedEvent]:
        self._cursor.add(text)
        events: list[ParsedEvent] = []
        while self._state != _OVER and self._step(events):
            pass
        return events

    def close(self) -> list[ParsedEvent]:
        if self._state == _NAME:  # `<tool_call>name</tool_call>`: a call without arguments
            name = self._cursor.text.strip()
            if name and len(self._cursor.text) < HEADER_LIMIT and "<" not in name:
                return [ToolCallStart(name), ToolCallArguments("{}")]
        elif self._state == _KEYS:
            return [ToolCallArguments(self._arguments.close())]
        return []

    def _step(self, events: list[ParsedEvent]) -> bool:
        cursor = self._cursor
        if self._state == _NAME:
            cursor.skip_space()
            line = cursor.until_any(("\n", KEY))
            if line is None:
                if len(cursor.text) >= HEADER_LIMIT + len(KEY):
                    self._state = _OVER
                return False
            name, marker = line[0].strip(), line[1]
            if not name or len(line[0]) >= HEADER_LIMIT:
                self._state = _OVER
                return False
            self._name = name
            events.append(ToolCallStart(name))
            self._state = _KEY if marker == KEY else _KEYS
            return True
        if self._state in (_KEYS, _VALUE_OPEN):
            opened = cursor.opens_with(KEY if self._state == _KEYS else VALUE)
            if opened is None:
                return False
            if not opened:
                self._state = _OVER
            elif self._state == _KEYS:
                self._state = _KEY
            else:
                self._state = _VALUE
                if self._kind == "string":
                    events.append(ToolCallArguments('"'))
            return opened
        if self._state == _KEY:
            key = cursor.until(KEY_END, HEADER_LIMIT)
            if key is None:
                if cursor.gave_up(KEY_END, HEADER_LIMIT):
                    self._state = _OVER
                return False
            self._kind = declared_type(self._schemas, self._name, key)
            events.append(ToolCallArguments(self._arguments.key(key)))
            self._state = _VALUE_OPEN
            return True
        if self._state == _VALUE:
            if not read_value(cursor, VALUE_END, self._kind, events, strip_newline=False):
                return False
            self._state = _KEYS
            return True
        return False


def stream(tools: ToolSchemas) -> ToolBlockStream:
    return ToolBlockStream(START, END, lambda: GlmCallReader(tools))


def forced_prefix(name: str | None) -> str:
    return START if name is None else START + name + "\n"
