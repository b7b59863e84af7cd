"""Incremental extraction of tool calls written as delimited sections of the output text.

Every supported format opens its calls with a marker (`<tool_call>`,
DeepSeek's `<｜tool▁calls▁begin｜>`, Kimi's `<|tool_calls_section_begin|>`,
Mistral's `[TOOL_CALLS]`) and, except Mistral's, closes them with another;
only what lies between differs, so one state machine serves them all and
each format supplies a `SectionReader` for the inside.

A reader announces a call (`ToolCallStart`) as soon as its name is known and
streams its arguments as they are written, so a client sees a long call
arrive token by token, as with OpenAI. From the announcement on it is a
call: if the output is cut off (or the syntax breaks) inside its arguments,
the call keeps the arguments written so far, as OpenAI returns a call cut
off by `max_tokens` (`ToolCall.complete` tells). A section in which no call
was announced is given back as ordinary content, so no text is ever lost.
Text outside sections streams as it comes, except a possible partial start
marker, and whitespace next to a call is dropped (held back until the next
character decides), because chat templates put their own separators around
calls: keeping it would make the assistant turn, once sent back, render to
different tokens than the model wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tokenspeed.api.parsers.events import ParsedEvent, TextPiece, ToolCallStart, partial_marker_len


class SectionReader(Protocol):
    def feed(self, text: str) -> list[ParsedEvent]:
        """More of the section (never past its end marker)."""
        ...

    def close(self) -> list[ParsedEvent]:
        """The section ended (its end marker, or the end of the output)."""
        ...


class ToolBlockStream:
    def __init__(self, start: str, end: str | None, new_reader: Callable[[], SectionReader]) -> None:
        self._start = start
        self._end = end  # None: a section runs to the end of the output
        self._new_reader = new_reader
        self._buffer = ""
        self._reader: SectionReader | None = None
        self._raw = ""  # the open section's text, given back if it holds no call
        self._called = False  # the open section announced a call
        self._held_space = ""  # trailing whitespace of the content, dropped if a call follows
        self._space_before_section = ""  # given back if the section turns out not to be a call
        self._after_call = False  # leading whitespace after a call is dropped

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buffer += text
        events: list[ParsedEvent] = []
        while True:
            if self._reader is not None:
                end = self._buffer.find(self._end) if self._end is not None else -1
                if end == -1:
                    keep = partial_marker_len(self._buffer, self._end) if self._end is not None else 0
                    self._section(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._section(self._buffer[:end], events)
                self._buffer = self._buffer[end + len(self._end or "") :]
                self._close_section(events, closed=True)
            else:
                start = self._buffer.find(self._start)
                if start == -1:
                    keep = partial_marker_len(self._buffer, self._start)
                    self._content(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._content(self._buffer[:start], events)
                self._space_before_section, self._held_space = self._held_space, ""
                self._buffer = self._buffer[start + len(self._start) :]
                self._reader, self._raw, self._called = self._new_reader(), "", False

    def finish(self) -> list[ParsedEvent]:
        events: list[ParsedEvent] = []
        if self._reader is not None:  # the output ended inside a section
            self._section(self._buffer, events)
            self._close_section(events, closed=False)
        else:
            self._content(self._buffer, events)
        self._buffer = ""
        if self._held_space and not self._after_call:
            events.append(TextPiece("content", self._held_space))
        self._held_space = ""
        return events

    def _section(self, text: str, events: list[ParsedEvent]) -> None:
        if not text:
            return
        assert self._reader is not None
        if not self._called:
            self._raw += text
        self._collect(self._reader.feed(text), events)

    def _collect(self, new: list[ParsedEvent], events: list[ParsedEvent]) -> None:
        if not self._called and any(isinstance(e, ToolCallStart) for e in new):
            self._called = True
            self._space_before_section = ""  # the whitespace before a call is dropped
        events.extend(new)

    def _close_section(self, events: list[ParsedEvent], *, closed: bool) -> None:
        assert self._reader is not None
        reader, self._reader = self._reader, None
        self._collect(reader.close(), events)
        if self._called:
            self._after_call = True
            return
        raw = self._start + self._raw + (self._end if closed and self._end is not None else "")
        self._held_space, self._space_before_section = self._space_before_section, ""
        self._content(raw, events)

    def _content(self, text: str, events: list[ParsedEvent]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body) :]
        if body:
            events.append(TextPiece("content", body))
