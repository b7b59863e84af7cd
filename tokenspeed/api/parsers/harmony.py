"""OpenAI's harmony format (gpt-oss): reasoning, answer and tool calls as channels of messages.

The prompt ends with `<|start|>assistant`; the output is one or more messages

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the recipient may also come before the channel: `assistant to=functions.x<|channel|>commentary json`).
The `analysis` channel is reasoning, `final` and recipient-less
`commentary` (preambles) are content, and a message to `functions.NAME` is
a tool call whose body is its JSON arguments, streamed as written. Other
recipients (the built-in browser and python tools) are not served; their
messages come back as content. A text that is not harmony at all comes back
as content too. The markers are special tokens, so the server decodes these
outputs with special tokens kept.
"""

from __future__ import annotations

import re

from tokenspeed.api.parsers.events import (
    ParsedEvent,
    TextPiece,
    ToolCallArguments,
    ToolCallStart,
    partial_marker_len,
)
from tokenspeed.api.parsers.json_stream import JsonStream
from tokenspeed.api.parsers.reading import HEADER_LIMIT, Cursor, ToolSchemas

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *TERMINATORS)
FUNCTIONS = "functions."

_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")

_HEADER, _BODY, _CALL, _SKIP, _BETWEEN, _TEXT = range(6)


class HarmonyStream:
    def __init__(self, *, parse_calls: bool) -> None:
        self._parse_calls = parse_calls
        self._cursor = Cursor()
        self._state = _HEADER
        self._kind: str = "content"  # where the current message's body goes
        self._json = JsonStream()

    def feed(self, text: str) -> list[ParsedEvent]:
        self._cursor.add(text)
        events: list[ParsedEvent] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[ParsedEvent]:
        events: list[ParsedEvent] = []
        while self._step(events, final=True):
            pass
        return events

    def _step(self, events: list[ParsedEvent], *, final: bool) -> bool:
        cursor = self._cursor
        if self._state == _TEXT:
            if cursor.text:
                events.append(TextPiece("content", cursor.consume(len(cursor.text))))
            return False
        if self._state == _BETWEEN:  # the next message: `<|start|>assistant...`, or a bare `<|channel|>...`
            cursor.skip_space()
            if cursor.opens_with(START) or cursor.text.startswith(CHANNEL):
                self._state = _HEADER
                return True
            if not final and (START.startswith(cursor.text) or CHANNEL.startswith(cursor.text)):
                return False
            self._state = _TEXT
            return bool(cursor.text)
        if self._state == _HEADER:
            header = cursor.until(MESSAGE, HEADER_LIMIT)
            if header is None:
                if final or cursor.gave_up(MESSAGE, HEADER_LIMIT):
                    self._state = _TEXT
                    return bool(cursor.text)
                return False
            self._open_message(header, events)
            return True
        body, ended = self._body(final)
        if self._state == _CALL:
            fragment = self._json.feed(body)
            if fragment:
                events.append(ToolCallArguments(fragment))
            if self._json.failed or self._json.done:
                self._state = _SKIP  # anything after the arguments, up to the terminator, is dropped
        elif self._state == _BODY and body:
            events.append(TextPiece("reasoning" if self._kind == "reasoning" else "content", body))
        if ended:
            self._state = _BETWEEN
        return ended

    def _open_message(self, header: str, events: list[ParsedEvent]) -> None:
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        name = recipient.group(1) if recipient is not None else ""
        if self._parse_calls and name.startswith(FUNCTIONS) and len(name) > len(FUNCTIONS):
            events.append(ToolCallStart(name[len(FUNCTIONS) :]))
            self._json, self._state = JsonStream(), _CALL
            return
        self._kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        self._state = _BODY

    def _body(self, final: bool) -> tuple[str, bool]:
        """The message body available now, and whether its terminator (or the output's end) was reached."""
        cursor = self._cursor
        found = cursor.until_any(TERMINATORS)
        if found is not None:
            return found[0], True
        if final:
            return cursor.consume(len(cursor.text)), True
        keep = max(partial_marker_len(cursor.text, marker) for marker in TERMINATORS)
        return cursor.consume(len(cursor.text) - keep), False


def stream(tools: ToolSchemas) -> HarmonyStream:
    return HarmonyStream(parse_calls=True)


def forced_prefix(name: str | None) -> str:
    opening = CHANNEL + "commentary to=" + FUNCTIONS
    return opening if name is None else opening + name + " " + CONSTRAIN + "json" + MESSAGE
