"""Calls written as JSON objects: `{"name": "f", "arguments": {...}}` (Hermes/Qwen, Llama 3, Mistral v3).

A section holds one such object, a list of them, or several separated by
`;` (Llama 3.2). A call is announced once its header `{"name": "...",
"arguments":` has been read (`"parameters"` is accepted for `"arguments"`),
and its arguments then stream through `JsonStream`. An object that does not
start that way (the name after the arguments, no arguments at all, or
arguments given as a JSON string: all seen in the wild) is read whole and
decoded when it closes, so such calls still work, only not incrementally. A
section that is not JSON objects at all is decoded whole when it closes
(`decode_calls`), and given back as text if that fails too.
"""

from __future__ import annotations

import re
from typing import Any

from tokenspeed.api.canonical_json import canonical_json
from tokenspeed.api.parsers.events import ParsedEvent, ToolCall, ToolCallStart, whole_call
from tokenspeed.api.parsers.json_stream import JsonArguments, JsonStream
from tokenspeed.api.parsers.reading import HEADER_LIMIT, Cursor, strict_loads

_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')

_BETWEEN, _HEADER_TEXT, _ARGUMENTS, _STRING_ARGUMENTS, _REST, _OVER, _UNSTREAMABLE = range(7)


def _call_from_object(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = strict_loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], canonical_json(arguments))


def decode_calls(text: str) -> list[ToolCall] | None:
    """Whole text → calls: one object, a list of them, or objects separated by `;`. None if any is not a call."""
    try:
        values = [strict_loads(text)]
    except ValueError:
        try:
            values = [strict_loads(part) for part in text.split(";")]
        except ValueError:
            return None
    objects = [o for v in values for o in (v if isinstance(v, list) else [v])]
    calls = [_call_from_object(obj) for obj in objects]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


class JsonCallsReader:
    def __init__(self) -> None:
        self._cursor = Cursor()
        self._state = _BETWEEN
        self._raw = ""  # all text, while no call is announced (for decode_calls)
        self._calls = 0
        self._first = True  # nothing but whitespace read yet: a "[" may open a list
        self._name = ""
        self._arguments = JsonArguments(list)
        self._json = JsonStream()  # the string-valued arguments, or the rest of the object after them
        self._object = ""  # the call object read so far, until its header is known
        self._object_json = JsonStream()  # finds the end of an object whose header is not the streamable one

    def feed(self, text: str) -> list[ParsedEvent]:
        if not self._calls:
            self._raw += text
        if self._state in (_OVER, _UNSTREAMABLE):
            return []
        self._cursor.add(text)
        events: list[ParsedEvent] = []
        while self._cursor.text and self._step(events):
            pass
        return events

    def close(self) -> list[ParsedEvent]:
        if not self._calls and self._state != _OVER:
            calls = decode_calls(self._raw.strip())
            return [e for call in calls or [] for e in whole_call(call)]
        return []

    def _step(self, events: list[ParsedEvent]) -> bool:
        """Advance one state; False when more text is needed."""
        cursor = self._cursor
        if self._state == _BETWEEN:
            cursor.skip_space()
            head = cursor.text[:1]
            if not head:
                return False
            if head in ("[" if self._first else ",;"):  # a list opens, or the next call follows
                cursor.consume(1)
            elif head == "]" and not self._first:
                self._state = _OVER
            elif head == "{":
                self._state, self._object, self._object_json = _HEADER_TEXT, "", JsonStream()
            else:
                self._give_up()
            self._first = False
            return True
        if self._state == _HEADER_TEXT:
            return self._header(events)
        if self._state == _ARGUMENTS:
            if not self._arguments.json.started:
                cursor.skip_space()
                if cursor.text.startswith('"'):
                    self._state, self._json, self._string = _STRING_ARGUMENTS, JsonStream(), ""
                    return True
            new: list[ParsedEvent] = []
            complete = self._arguments.read(cursor, new)
            self._calls += any(isinstance(e, ToolCallStart) for e in new)
            events.extend(new)
            return self._after_value(complete)
        if self._state == _STRING_ARGUMENTS:
            self._string += self._json.feed(cursor.consume(len(cursor.text)))
            complete = True if self._json.done else False if self._json.failed else None
            if complete:
                self._calls += 1
                events.extend(whole_call(ToolCall(self._name, _string_arguments(self._string))))
                cursor.add(self._json.tail)
            return self._after_value(complete)
        if self._state == _REST:  # the rest of the call object, e.g. `, "id": 3}`
            self._json.feed(cursor.consume(len(cursor.text)))
            if self._json.done:
                cursor.add(self._json.tail)
                self._state = _BETWEEN
                return True
            if self._json.failed:
                self._state = _OVER
            return False
        return False

    def _header(self, events: list[ParsedEvent]) -> bool:
        """Reading a call object until its header is known, or the object is complete."""
        text = self._cursor.consume(len(self._cursor.text))
        self._object += text
        self._object_json.feed(text)
        match = _HEADER.match(self._object[:HEADER_LIMIT])
        name = _name(match.group(1)) if match is not None else ""
        if name:
            assert match is not None
            self._name = name
            self._arguments = JsonArguments(lambda: [ToolCallStart(name)])
            self._cursor.add(self._object[match.end() :])
            self._state = _ARGUMENTS
            return True
        if self._object_json.done:
            tail = self._object_json.tail
            call = _call_from_object(_loads_or_none(self._object[: len(self._object) - len(tail)]))
            if call is None:
                self._give_up()
                return False
            self._calls += 1
            events.extend(whole_call(call))
            self._cursor.add(tail)
            self._state = _BETWEEN
            return True
        if self._object_json.failed:
            self._give_up()
        return False

    def _give_up(self) -> None:
        """Not a call: the rest is dropped after calls, and the section is decoded whole if there were none."""
        self._state = _OVER if self._calls else _UNSTREAMABLE

    def _after_value(self, complete: bool | None) -> bool:
        """The arguments ended (True: go on to the rest of the object), broke (False) or go on (None)."""
        if complete is None:
            return False
        if not complete:
            self._give_up()
            return False
        self._json = JsonStream(inside_object=True)
        self._state = _REST
        return True


def _name(literal: str) -> str:
    try:
        name = strict_loads(literal)
    except ValueError:
        return ""
    return name if isinstance(name, str) else ""


def _loads_or_none(text: str) -> Any:
    try:
        return strict_loads(text)
    except ValueError:
        return None


def _string_arguments(literal: str) -> str:
    """Arguments a model wrote as a JSON string holding JSON: canonical when they hold an object."""
    inner = strict_loads(literal)
    try:
        value = strict_loads(inner)
    except ValueError:
        return str(inner)
    return canonical_json(value) if isinstance(value, dict) else str(inner)
