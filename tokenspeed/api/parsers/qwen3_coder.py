"""Qwen3-Coder tool calls (its chat template and model card describe them):

    <tool_call>
    <function=write_file>
    <parameter=path>
    src/app.py
    </parameter>
    <parameter=content>
    print("hello")
    </parameter>
    </function>
    </tool_call>

The template writes one newline after `<parameter=...>` and one before
`</parameter>`; they are not part of the value. A call is announced once
`<function=NAME>` is read; string parameters (file contents, commands:
what coding agents send) stream as they are written, other values once
their parameter closes (`xml_values.py` types them by the tool's schema).
"""

from __future__ import annotations

from tokenspeed.api.parsers.events import ParsedEvent, ToolCallArguments, ToolCallStart
from tokenspeed.api.parsers.reading import HEADER_LIMIT, Cursor, ToolSchemas
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream
from tokenspeed.api.parsers.xml_values import ArgumentsWriter, declared_type, read_value

START = "<tool_call>"
END = "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
MARKERS = (START, END)

_FUNCTION, _NAME, _PARAMETERS, _KEY, _VALUE_START, _VALUE, _OVER = range(7)


class QwenCoderCallReader:
    def __init__(self, schemas: ToolSchemas) -> None:
        self._schemas = schemas
        self._cursor = Cursor()
        self._state = _FUNCTION
        self._name = ""
        self._kind: str | None = None
        self._arguments = ArgumentsWriter()

    def feed(self, text: str) -> list[ParsedEvent]:
        self._cursor.add(text)
        events: list[ParsedEvent] = []
        while self._state != _OVER and self._step(events):
            pass
        return events

    def close(self) -> list[ParsedEvent]:
        if self._state == _PARAMETERS:  # `</function>` left out: every parameter is complete all the same
            return [ToolCallArguments(self._arguments.close())]
        return []

    def _step(self, events: list[ParsedEvent]) -> bool:
        cursor = self._cursor
        if self._state == _FUNCTION:
            opened = cursor.opens_with(FUNCTION)
            if opened is None:
                return False
            self._state = _NAME if opened else _OVER
            return opened
        if self._state in (_NAME, _KEY):
            head = cursor.until(">", HEADER_LIMIT)
            if head is None:
                if cursor.gave_up(">", HEADER_LIMIT):
                    self._state = _OVER
                return False
            if not head.strip():
                self._state = _OVER
                return False
            if self._state == _NAME:
                self._name = head.strip()
                self._arguments = ArgumentsWriter()
                events.append(ToolCallStart(self._name))
                self._state = _PARAMETERS
            else:
                self._kind = declared_type(self._schemas, self._name, head.strip())
                events.append(ToolCallArguments(self._arguments.key(head.strip())))
                self._state = _VALUE_START
            return True
        if self._state == _PARAMETERS:
            cursor.skip_space()
            text = cursor.text
            if text.startswith(PARAMETER):
                cursor.consume(len(PARAMETER))
                self._state = _KEY
            elif text.startswith(FUNCTION_END):
                cursor.consume(len(FUNCTION_END))
                events.append(ToolCallArguments(self._arguments.close()))
                self._state = _FUNCTION
            elif PARAMETER.startswith(text) or FUNCTION_END.startswith(text):
                return False
            else:
                self._state = _OVER
            return True
        if self._state == _VALUE_START:
            if not cursor.text:
                return False
            if cursor.text.startswith("\n"):
                cursor.consume(1)
            if self._kind == "string":
                events.append(ToolCallArguments('"'))
            self._state = _VALUE
            return True
        if self._state == _VALUE:
            if not read_value(cursor, PARAMETER_END, self._kind, events, strip_newline=True):
                return False
            self._state = _PARAMETERS
            return True
        return False


def stream(tools: ToolSchemas) -> ToolBlockStream:
    return ToolBlockStream(START, END, lambda: QwenCoderCallReader(tools))


def forced_prefix(name: str | None) -> str:
    opening = START + "\n" + FUNCTION
    return opening if name is None else opening + name + ">\n"
