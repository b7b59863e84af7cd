"""One JSON value, read as it is written and re-serialised canonically on the fly.

Tool-call arguments stream to the client while the model writes them, yet we
answer with canonical arguments (`canonical_json.py`: `", "` / `": "`
separators, UTF-8 kept, key order kept), because agents send them back and
the next turn's prompt must render to the tokens the model wrote. So the
arguments are re-serialised as they arrive: whitespace between tokens is
dropped, separators and string escapes are normalised, and a number is
written once it is complete (`1.50` -> `1.5`, as `json.dumps(json.loads(..))`
does). What has been emitted is therefore always a prefix of
`canonical_json(json.loads(value))`, and the fragments of a complete value
concatenate to exactly that. (One deliberate difference: a lone UTF-16
surrogate escape stays escaped, because a raw one cannot be sent as UTF-8.)

Syntax is strict JSON (no NaN, no raw control characters in strings, no
trailing commas) and an error is found at the first character that cannot
continue the value: `failed` is set and the rest is not read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from tokenspeed.api.parsers.events import ParsedEvent, ToolCallArguments
from tokenspeed.api.parsers.reading import Cursor

_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters that need no escaping
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "/", "b": "\\b", "f": "\\f", "n": "\\n", "r": "\\r", "t": "\\t"}
_WHITESPACE = " \t\n\r"

# what the reader expects next
_VALUE, _FIRST_KEY, _KEY, _COLON, _FIRST_ITEM, _AFTER_VALUE = range(6)
_STRING, _ESCAPE, _UNICODE, _NUMBER_TOKEN, _LITERAL = range(6, 11)


def _escaped(char: str) -> str:
    if "\ud800" <= char <= "\udfff":  # lone surrogate: keep it an escape (it cannot be encoded)
        return f"\\u{ord(char):04x}"
    return json.dumps(char, ensure_ascii=False)[1:-1]


class JsonStream:
    """Feed text; get canonical JSON text back. Stops at the end of the value (`done`); what follows is `tail`."""

    def __init__(self, *, inside_object: bool = False) -> None:
        """`inside_object`: start just after a member of an object (to read, and drop, the rest of it)."""
        self._state = _AFTER_VALUE if inside_object else _VALUE
        self._stack: list[str] = ["{"] if inside_object else []  # open containers, "{" or "["
        self._in_key = False
        self._token = ""  # a number, literal or \\u escape being read
        self._high_surrogate: int | None = None  # a \\ud800-\\udbff escape waiting for its pair
        self.done = False
        self.failed = False
        self.tail = ""
        self.read_first_key = False  # a top-level object's first key is complete

    @property
    def started(self) -> bool:
        return self._state != _VALUE or bool(self._stack)

    def feed(self, text: str) -> str:
        if self.done or self.failed:
            if self.done:
                self.tail += text
            return ""
        out: list[str] = []
        position = 0
        while position < len(text) and not (self.done or self.failed):
            if self._state == _STRING:  # the bulk of real arguments: take plain runs at once
                run = _PLAIN_RUN.match(text, position)
                if run is not None:
                    out.append(self._flush_surrogate() + run.group())
                    position = run.end()
                    continue
            position = self._step(text, position, out)
        if self.done:
            self.tail = text[position:]
        return "".join(out)

    def finish(self) -> str:
        """The output ended: a top-level number is complete now; anything else still open stays unfinished."""
        if self._state == _NUMBER_TOKEN and not self._stack and not self.failed:
            out: list[str] = []
            self._end_number(out)
            return "".join(out)
        return ""

    # ---- one character ----------------------------------------------------------------------

    def _step(self, text: str, position: int, out: list[str]) -> int:
        char = text[position]
        state = self._state
        if state == _STRING:
            if char == '"':
                out.append(self._flush_surrogate() + '"')
                self._end_string()
            elif char == "\\":
                self._state = _ESCAPE
            else:  # a raw control character
                self.failed = True
            return position + 1
        if state == _ESCAPE:
            if char == "u":
                self._state, self._token = _UNICODE, ""
            elif char in _SHORT_ESCAPES:
                out.append(self._flush_surrogate() + _SHORT_ESCAPES[char])
                self._state = _STRING
            else:
                self.failed = True
            return position + 1
        if state == _UNICODE:
            if char not in "0123456789abcdefABCDEF":
                self.failed = True
                return position + 1
            self._token += char
            if len(self._token) == 4:
                self._unicode(int(self._token, 16), out)
                self._state = _STRING
            return position + 1
        if state == _NUMBER_TOKEN:
            if char in _NUMBER_CHARS:
                self._token += char
                return position + 1
            self._end_number(out)
            return position if not self.failed else position + 1
        if state == _LITERAL:
            self._token += char
            if self._token in _LITERALS:
                out.append(self._token)
                self._after_value()
            elif not any(literal.startswith(self._token) for literal in _LITERALS):
                self.failed = True
            return position + 1
        if char in _WHITESPACE:
            return position + 1
        self._structural(char, out)
        return position + 1

    def _structural(self, char: str, out: list[str]) -> None:
        state = self._state
        if state == _FIRST_KEY and char == "}":
            self._close("{", "}", out)
        elif state in (_FIRST_KEY, _KEY):
            if char == '"':
                out.append('"')
                self._state, self._in_key = _STRING, True
            else:
                self.failed = True
        elif state == _COLON:
            if char == ":":
                out.append(": ")
                self._state = _VALUE
            else:
                self.failed = True
        elif state == _FIRST_ITEM and char == "]":
            self._close("[", "]", out)
        elif state in (_VALUE, _FIRST_ITEM):
            self._value(char, out)
        elif state == _AFTER_VALUE:
            if char == "," and self._stack:
                out.append(", ")
                self._state = _KEY if self._stack[-1] == "{" else _VALUE
            elif char == "}":
                self._close("{", "}", out)
            elif char == "]":
                self._close("[", "]", out)
            else:
                self.failed = True

    def _value(self, char: str, out: list[str]) -> None:
        if char == "{":
            out.append("{")
            self._stack.append("{")
            self._state = _FIRST_KEY
        elif char == "[":
            out.append("[")
            self._stack.append("[")
            self._state = _FIRST_ITEM
        elif char == '"':
            out.append('"')
            self._state, self._in_key = _STRING, False
        elif char == "-" or char.isdigit():
            self._state, self._token = _NUMBER_TOKEN, char
        elif char in "tfn":
            self._state, self._token = _LITERAL, char
        else:
            self.failed = True

    def _close(self, opener: str, closer: str, out: list[str]) -> None:
        if not self._stack or self._stack[-1] != opener:
            self.failed = True
            return
        self._stack.pop()
        out.append(closer)
        self._after_value()

    def _after_value(self) -> None:
        self._state = _AFTER_VALUE
        if not self._stack:
            self.done = True

    def _end_string(self) -> None:
        if self._in_key:
            self.read_first_key = self.read_first_key or len(self._stack) == 1
            self._state, self._in_key = _COLON, False
        else:
            self._after_value()

    def _end_number(self, out: list[str]) -> None:
        if _NUMBER.fullmatch(self._token) is None:
            self.failed = True
            return
        out.append(json.dumps(json.loads(self._token)))
        self._after_value()

    def _unicode(self, code: int, out: list[str]) -> None:
        if self._high_surrogate is not None:
            high, self._high_surrogate = self._high_surrogate, None
            if 0xDC00 <= code <= 0xDFFF:
                out.append(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                return
            out.append(_escaped(chr(high)))
        if 0xD800 <= code <= 0xDBFF:
            self._high_surrogate = code
        else:
            out.append(_escaped(chr(code)))

    def _flush_surrogate(self) -> str:
        if self._high_surrogate is None:
            return ""
        high, self._high_surrogate = self._high_surrogate, None
        return _escaped(chr(high))


class JsonArguments:
    """A call's JSON arguments, announced with the call only once they have begun well-formed.

    Models sometimes open a call and then write something that is not JSON;
    announcing at the name would turn that text into a broken call. So the
    call is held back until its arguments have opened an object and read its
    first key (or closed, `{}`); text that fails before is not a call.
    """

    def __init__(self, announce: Callable[[], list[ParsedEvent]]) -> None:
        self._announce = announce
        self._held = ""
        self.announced = False
        self.json = JsonStream()

    @property
    def rejected(self) -> bool:
        return not self.announced and (self.json.failed or not "{".startswith(self._held[:1]))

    def read(self, cursor: Cursor, events: list[ParsedEvent]) -> bool | None:
        """Take all of `cursor`'s text into `events`: None while the arguments go on, True once they are complete
        (what follows them goes back to the cursor), False if they failed (or were never a call)."""
        events.extend(self.feed(cursor.consume(len(cursor.text))))
        if self.rejected or self.json.failed:
            return False
        if self.json.done:
            cursor.add(self.json.tail)
            return True
        return None

    def feed(self, text: str) -> list[ParsedEvent]:
        fragment = self.json.feed(text)
        if self.announced:
            return [ToolCallArguments(fragment)] if fragment else []
        self._held += fragment
        if self.rejected or not (self.json.done or self.json.read_first_key):
            return []
        self.announced = True
        return [*self._announce(), ToolCallArguments(self._held)]
