"""Incremental extraction of tool calls written as delimited blocks in the output text.

Every supported format wraps calls in a start and an end marker (`<tool_call>`
… `</tool_call>`, DeepSeek's `<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>`);
only the block's inner syntax differs, so one state machine serves them all
and each format supplies `decode_block`.

A call is emitted when its block closes: a half-written call is not
actionable, clients accumulate arguments anyway, and waiting lets us check
the JSON before promising a call. A block that does not decode is given back
as ordinary content, so no text is ever lost. Text outside blocks streams as
it comes, except a possible partial start marker, and whitespace next to a
call is dropped (held back until the next character decides), because chat
templates put their own separators around calls: keeping it would make the
assistant turn, once sent back, render to different tokens than the model
wrote.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenspeed.api.parsers.events import ParsedEvent, TextPiece, ToolCall, partial_marker_len

DecodeBlock = Callable[[str], list[ToolCall] | None]


class ToolBlockStream:
    def __init__(self, start: str, end: str, decode_block: DecodeBlock) -> None:
        self._start = start
        self._end = end
        self._decode = decode_block
        self._buffer = ""
        self._in_block = False
        self._scanned = 0  # the block buffer holds no end marker before this offset
        self._held_space = ""  # trailing whitespace of the content, dropped if a call follows
        self._space_before_block = ""  # given back if the block turns out not to be a call
        self._after_call = False  # leading whitespace after a call is dropped

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buffer += text
        events: list[ParsedEvent] = []
        while True:
            if self._in_block:
                end = self._buffer.find(self._end, self._scanned)
                if end == -1:  # a long call arrives in many deltas: never rescan what was searched
                    self._scanned = max(0, len(self._buffer) - len(self._end) + 1)
                    return events
                self._scanned = 0
                self._close_block(self._buffer[:end], events, closed=True)
                self._buffer = self._buffer[end + len(self._end) :]
            else:
                start = self._buffer.find(self._start)
                if start == -1:
                    keep = partial_marker_len(self._buffer, self._start)
                    self._content(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._content(self._buffer[:start], events)
                self._space_before_block, self._held_space = self._held_space, ""
                self._buffer = self._buffer[start + len(self._start) :]
                self._in_block = True

    def finish(self) -> list[ParsedEvent]:
        events: list[ParsedEvent] = []
        if self._in_block:  # the output ended inside a block: decode it if it is complete anyway
            self._close_block(self._buffer, events, closed=False)
        else:
            self._content(self._buffer, events)
        self._buffer = ""
        if self._held_space and not self._after_call:
            events.append(TextPiece("content", self._held_space))
        self._held_space = ""
        return events

    def _close_block(self, inner: str, events: list[ParsedEvent], *, closed: bool) -> None:
        self._in_block = False
        calls = self._decode(inner)
        if calls:
            events.extend(calls)
            self._after_call = True
            return
        raw = self._start + inner + (self._end if closed else "")
        self._held_space, self._space_before_block = self._space_before_block, ""
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
