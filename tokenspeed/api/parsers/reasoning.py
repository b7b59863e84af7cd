"""Reasoning parsers: split `<think>…</think>` (or the model's own markers) from the answer, incrementally.

Two conventions exist in the wild:

* the model itself opens `<think>` at the start of its output (`qwen3`,
  `glm45`, and `mistral` with `[THINK]…[/THINK]`); an output that does not
  start with it has no reasoning (e.g. thinking was switched off through the
  chat template);
* the chat template already opened `<think>` in the prompt (`deepseek_r1`,
  `kimi_k2`), so the output starts inside the reasoning (a leading `<think>`
  is tolerated) and everything up to `</think>` is reasoning — all of it, if
  the model never closes the block (the answer was cut off while thinking).
  Kimi-K2 may also end its reasoning by opening a tool-call section. When
  the request switched thinking off (`chat_template_kwargs`
  `enable_thinking`/`thinking` false, Anthropic `thinking.type: disabled`)
  the output is all answer.

`openai_gptoss` is the harmony format (`harmony.py`), whose `analysis`
channel is the reasoning.

The split is normalised the way ChatML templates render reasoning back
(`'<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content`):
newlines around the reasoning and whitespace before the answer are dropped,
so an assistant turn sent back by the client renders to the tokens the model
wrote. Newlines at the end of the reasoning are held back until we know
whether more reasoning follows, which keeps streaming and non-streaming
output identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenspeed.api.parsers import harmony
from tokenspeed.api.parsers.events import ParsedEvent, ParserStage, TextPiece, partial_marker_len
from tokenspeed.api.parsers.kimi_k2 import START as KIMI_TOOL_SECTION

THINK_START = "<think>"
THINK_END = "</think>"

_DECIDING, _REASONING, _CONTENT = "deciding", "reasoning", "content"


class ReasoningStream:
    """Feeds text deltas; returns reasoning/content pieces in order. One per completion."""

    def __init__(
        self, *, starts_in_reasoning: bool, start: str = THINK_START, end: str = THINK_END,
        ends_before: tuple[str, ...] = (),
    ) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._start = start
        self._end = end
        self._ends_before = ends_before  # markers that end the reasoning and belong to the answer
        self._state = _DECIDING
        self._buffer = ""  # text not yet classified
        self._reasoning_started = False  # leading newlines of the reasoning are dropped
        self._held_newlines = ""  # trailing newlines of the reasoning so far
        self._content_started = False  # leading whitespace of the answer is dropped

    def feed(self, text: str) -> list[ParsedEvent]:
        self._buffer += text
        pieces: list[ParsedEvent] = []
        if self._state == _DECIDING:
            self._decide(final=False)
        if self._state == _REASONING:
            self._consume_reasoning(pieces, final=False)
        if self._state == _CONTENT:
            self._consume_content(pieces)
        return pieces

    def finish(self) -> list[ParsedEvent]:
        pieces: list[ParsedEvent] = []
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
        if stripped.startswith(self._start):
            self._buffer = stripped[len(self._start) :]
            self._state = _REASONING
        elif not final and (not stripped or self._start.startswith(stripped)):
            return  # could still become "<think>"
        else:
            self._state = _REASONING if self._starts_in_reasoning else _CONTENT
            if self._state == _CONTENT:
                self._content_started = True  # no reasoning: the answer is kept verbatim

    def _consume_reasoning(self, pieces: list[ParsedEvent], *, final: bool) -> None:
        ends = [(i, m, len(m)) for m in (self._end,) if (i := self._buffer.find(m)) != -1]
        ends += [(i, m, 0) for m in self._ends_before if (i := self._buffer.find(m)) != -1]
        if ends:
            end, _, skip = min(ends)
            self._emit_reasoning(self._buffer[:end], pieces, closing=True)
            self._buffer = self._buffer[end + skip :]
            self._state = _CONTENT
            return
        markers = (self._end, *self._ends_before)
        keep = 0 if final else max(partial_marker_len(self._buffer, m) for m in markers)
        ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
        self._emit_reasoning(ready, pieces, closing=final)

    def _emit_reasoning(self, text: str, pieces: list[ParsedEvent], *, closing: bool) -> None:
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

    def _consume_content(self, pieces: list[ParsedEvent]) -> None:
        text, self._buffer = self._buffer, ""
        if not text:
            return
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return
            self._content_started = True
        pieces.append(TextPiece("content", text))


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    stream: Callable[[bool], ParserStage]  # argument: is thinking on?
    markers: tuple[str, ...]  # its syntax (kept when the tokenizer would hide them as special tokens)


def _opened_by_model(start: str, end: str) -> Callable[[bool], ReasoningStream]:
    return lambda thinking: ReasoningStream(starts_in_reasoning=False, start=start, end=end)


def _opened_by_template(*, ends_before: tuple[str, ...] = ()) -> Callable[[bool], ReasoningStream]:
    return lambda thinking: ReasoningStream(starts_in_reasoning=thinking, ends_before=ends_before)


_THINK = (THINK_START, THINK_END)
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat("qwen3", _opened_by_model(*_THINK), _THINK),
        ReasoningFormat("glm45", _opened_by_model(*_THINK), _THINK),
        ReasoningFormat("mistral", _opened_by_model("[THINK]", "[/THINK]"), ("[THINK]", "[/THINK]")),
        ReasoningFormat("deepseek_r1", _opened_by_template(), _THINK),
        ReasoningFormat("kimi_k2", _opened_by_template(ends_before=(KIMI_TOOL_SECTION,)),
                        (*_THINK, KIMI_TOOL_SECTION)),
        ReasoningFormat("openai_gptoss", lambda thinking: harmony.HarmonyStream(parse_calls=False), harmony.MARKERS),
    )
}


def reasoning_stream(name: str, thinking: bool = True) -> ParserStage:
    return REASONING_PARSERS[name].stream(thinking)


def thinking_requested(template_kwargs: dict[str, object] | None) -> bool:
    """False when the request switched thinking off through the chat template (Qwen3's `enable_thinking`,
    Kimi's and DeepSeek's `thinking`): the template then opens no reasoning block for the model."""
    kwargs = template_kwargs or {}
    return kwargs.get("enable_thinking", True) is not False and kwargs.get("thinking", True) is not False
