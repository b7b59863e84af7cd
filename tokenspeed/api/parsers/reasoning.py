"""Reasoning parsers: split `<think>…</think>` from the answer, incrementally.

Two conventions exist in the wild:

* `qwen3`: the model itself opens `<think>` at the start of its output; an
  output that does not start with it has no reasoning (e.g. thinking was
  switched off through the chat template).
* `deepseek_r1`: the chat template already opened `<think>` in the prompt, so
  the output starts inside the reasoning (a leading `<think>` is tolerated)
  and everything up to `</think>` is reasoning — all of it, if the model never
  closes the block (the answer was cut off while thinking).

The split is normalised the way ChatML templates render reasoning back
(`'<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content`):
newlines around the reasoning and whitespace before the answer are dropped,
so an assistant turn sent back by the client renders to the tokens the model
wrote. Newlines at the end of the reasoning are held back until we know
whether more reasoning follows, which keeps streaming and non-streaming
output identical.
"""

from __future__ import annotations

from tokenspeed.api.parsers.events import TextPiece, partial_marker_len

THINK_START = "<think>"
THINK_END = "</think>"

_DECIDING, _REASONING, _CONTENT = "deciding", "reasoning", "content"


class ReasoningStream:
    """Feeds text deltas; returns reasoning/content pieces in order. One per completion."""

    def __init__(self, *, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._state = _DECIDING
        self._buffer = ""  # text not yet classified
        self._reasoning_started = False  # leading newlines of the reasoning are dropped
        self._held_newlines = ""  # trailing newlines of the reasoning so far
        self._content_started = False  # leading whitespace of the answer is dropped

    def feed(self, text: str) -> list[TextPiece]:
        self._buffer += text
        pieces: list[TextPiece] = []
        if self._state == _DECIDING:
            self._decide(final=False)
        if self._state == _REASONING:
            self._consume_reasoning(pieces, final=False)
        if self._state == _CONTENT:
            self._consume_content(pieces)
        return pieces

    def finish(self) -> list[TextPiece]:
        pieces: list[TextPiece] = []
        if self._state == _DECIDING:
            self._decide(final=True)
        if self._state == _REASONING:
            self._consume_reasoning(pieces, final=True)
        if self._state == _CONTENT:
            self._consume_content(pieces)
        return pieces

    # ---- states ---------------------------------------------------------------------

    def _decide(self, *, final: bool) -> None:
        """Is there a leading `<think>`? Wait until the text says yes or no."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(THINK_START):
            self._buffer = stripped[len(THINK_START) :]
            self._state = _REASONING
        elif not final and (not stripped or THINK_START.startswith(stripped)):
            return  # could still become "<think>"
        else:
            self._state = _REASONING if self._starts_in_reasoning else _CONTENT
            if self._state == _CONTENT:
                self._content_started = True  # no reasoning: the answer is kept verbatim

    def _consume_reasoning(self, pieces: list[TextPiece], *, final: bool) -> None:
        end = self._buffer.find(THINK_END)
        if end != -1:
            self._emit_reasoning(self._buffer[:end], pieces, closing=True)
            self._buffer = self._buffer[end + len(THINK_END) :]
            self._state = _CONTENT
            return
        keep = 0 if final else partial_marker_len(self._buffer, THINK_END)
        ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
        self._emit_reasoning(ready, pieces, closing=final)

    def _emit_reasoning(self, text: str, pieces: list[TextPiece], *, closing: bool) -> None:
        if not self._reasoning_started:
            text = text.lstrip("\n")
            if not text:
                return
            self._reasoning_started = True
        text = self._held_newlines + text
        body = text.rstrip("\n")
        self._held_newlines = "" if closing else text[len(body) :]
        if body:
            pieces.append(TextPiece("reasoning", body))

    def _consume_content(self, pieces: list[TextPiece]) -> None:
        text, self._buffer = self._buffer, ""
        if not text:
            return
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return
            self._content_started = True
        pieces.append(TextPiece("content", text))


REASONING_PARSERS: dict[str, bool] = {
    "qwen3": False,  # value: does the output start inside the reasoning?
    "deepseek_r1": True,
}


def reasoning_stream(name: str) -> ReasoningStream:
    return ReasoningStream(starts_in_reasoning=REASONING_PARSERS[name])
