"""Small pieces the tool-call readers share: a text cursor that waits for markers, JSON helpers.

Readers decide only on text they have: a marker that may still be
completing is waited for (never guessed), so what a reader emits depends on
the text so far and not on how it was cut into deltas.
"""

from __future__ import annotations

import json
from typing import Any

from tokenspeed.api.canonical_json import canonical_json
from tokenspeed.api.parsers.events import partial_marker_len

HEADER_LIMIT = 512  # a call's header (name, id, markers) is at most this long, so waiting for it is bounded


class Cursor:
    """Text received but not consumed yet."""

    def __init__(self) -> None:
        self.text = ""
        self._searched = 0  # no marker looked for by `until` starts before this offset

    def add(self, text: str) -> None:
        self.text += text

    def consume(self, count: int) -> str:
        taken, self.text = self.text[:count], self.text[count:]
        self._searched = 0
        return taken

    def skip_space(self) -> None:
        stripped = self.text.lstrip()
        if len(stripped) != len(self.text):
            self.consume(len(self.text) - len(stripped))

    def opens_with(self, marker: str) -> bool | None:
        """After whitespace, does the text start with `marker` (consumed if so)? None: too short to say."""
        self.skip_space()
        if self.text.startswith(marker):
            self.consume(len(marker))
            return True
        return None if marker.startswith(self.text) else False

    def until(self, marker: str, limit: int | None = None) -> str | None:
        """Text before `marker`, consuming both; None (nothing consumed) until the marker has arrived
        (within the first `limit` characters, when given: see `gave_up`)."""
        index = self.text.find(marker, self._searched)
        if index == -1 or (limit is not None and index >= limit):
            self._searched = max(0, len(self.text) - len(marker) + 1)
            return None
        head = self.text[:index]
        self.consume(index + len(marker))
        return head

    def gave_up(self, marker: str, limit: int) -> bool:
        """Has `until(marker, limit)` missed for good (a marker starting within `limit` would be here)?"""
        return len(self.text) >= limit + len(marker)

    def until_any(self, markers: tuple[str, ...]) -> tuple[str, str] | None:
        """(text before the first of `markers` to appear, that marker), consuming both; None until one arrives."""
        found = [(i, m) for m in markers if (i := self.text.find(m)) != -1]
        if not found:
            return None
        index, marker = min(found)
        head = self.text[:index]
        self.consume(index + len(marker))
        return head, marker

    def safe_prefix(self, marker: str, hold: str = "") -> str:
        """Consume and return what surely lies before `marker`: all but a partial marker and trailing `hold`
        characters (which the end of a value may strip)."""
        keep = partial_marker_len(self.text, marker)
        ready = self.text[: len(self.text) - keep]
        body = ready.rstrip(hold) if hold else ready
        return self.consume(len(body))


def json_string_body(text: str) -> str:
    """`text` as the inside of a canonical JSON string (escaped piece by piece, concatenation-safe)."""
    return canonical_json(text)[1:-1]


def strict_loads(text: str) -> Any:
    """`json.loads` without the NaN/Infinity extensions (they are not JSON, and clients reject them)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


ToolSchemas = dict[str, dict[str, Any]]  # tool name -> its JSON-schema `parameters`
