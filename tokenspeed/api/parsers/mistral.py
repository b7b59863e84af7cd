"""Mistral tool calls: everything after `[TOOL_CALLS]` up to the end of the output.

Two generations of the format exist (Mistral's tokenizer versions):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      v3 (Mistral 7B v0.3, Nemo)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...              v11+ (Small 3.2, Devstral)

(v7 writes `name[CALL_ID]id[ARGS]{...}`; the id is kept.) `[TOOL_CALLS]`
and `[ARGS]` are special tokens, so the server decodes these outputs with
special tokens kept. Mistral's templates want tool-call ids of 9
alphanumeric characters; `registry.py` makes ours so.
"""

from __future__ import annotations

from tokenspeed.api.parsers.events import ParsedEvent, ToolCallStart
from tokenspeed.api.parsers.json_calls import JsonCallsReader
from tokenspeed.api.parsers.json_stream import JsonArguments
from tokenspeed.api.parsers.reading import HEADER_LIMIT, Cursor, ToolSchemas
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream

START = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
MARKERS = (START, ARGS, CALL_ID)

_FIRST, _NAME, _ID, _ARGUMENTS, _BETWEEN, _LIST, _OVER = range(7)


class MistralCallsReader:
    def __init__(self) -> None:
        self._cursor = Cursor()
        self._state = _FIRST
        self._name = ""
        self._arguments = JsonArguments(list)
        self._list = JsonCallsReader()  # the v3 form

    def feed(self, text: str) -> list[ParsedEvent]:
        if self._state == _LIST:
            return self._list.feed(text)
        self._cursor.add(text)
        events: list[ParsedEvent] = []
        while self._state not in (_OVER, _LIST) and self._step(events):
            pass
        return events

    def close(self) -> list[ParsedEvent]:
        return self._list.close() if self._state == _LIST else []

    def _step(self, events: list[ParsedEvent]) -> bool:
        cursor = self._cursor
        if self._state == _FIRST:
            cursor.skip_space()
            if not cursor.text:
                return False
            if cursor.text.startswith("["):
                self._state = _LIST
                events.extend(self._list.feed(cursor.consume(len(cursor.text))))
                return False
            self._state = _NAME
            return True
        if self._state == _BETWEEN:
            opened = cursor.opens_with(START)
            if opened is None:
                return False
            self._state = _NAME if opened else _OVER
            return opened
        if self._state in (_NAME, _ID):
            found = cursor.until_any((ARGS, CALL_ID) if self._state == _NAME else (ARGS,))
            if found is None or len(found[0]) >= HEADER_LIMIT or not found[0].strip():
                if found is not None or len(cursor.text) >= HEADER_LIMIT + len(CALL_ID):
                    self._state = _OVER
                return False
            head, marker = found[0].strip(), found[1]
            if marker == CALL_ID:
                self._name, self._state = head, _ID
                return True
            start = ToolCallStart(self._name, head) if self._state == _ID else ToolCallStart(head)
            self._arguments, self._state = JsonArguments(lambda: [start]), _ARGUMENTS
            return True
        if self._state == _ARGUMENTS:
            complete = self._arguments.read(cursor, events)
            if complete is not None:
                self._state = _BETWEEN if complete else _OVER
            return bool(complete)
        return False


def stream(tools: ToolSchemas) -> ToolBlockStream:
    return ToolBlockStream(START, None, MistralCallsReader)


def forced_prefix(name: str | None) -> str:
    """The v11+ form (current Mistral models); a v3 model is only steered to open its list."""
    return START if name is None else START + name + ARGS
