"""Arguments written one parameter at a time in markup (Qwen3-Coder, GLM-4.5), turned into canonical JSON.

These formats write each value as bare text: strings as they are, other
values as JSON (or, for Qwen3-Coder's template, Python's `True`/`False`).
So the type comes from the tool's JSON schema: a `string` parameter is kept
verbatim (and streams as it is written), anything else is read as JSON when
it parses and kept as a string when it does not. A parameter the schema does
not declare is read as JSON when it parses. The arguments object is written
key by key with `canonical_json`'s separators, so the streamed pieces
concatenate to `canonical_json(arguments)`.
"""

from __future__ import annotations

from typing import Any

from tokenspeed.api.canonical_json import canonical_json
from tokenspeed.api.parsers.events import ParsedEvent, ToolCallArguments
from tokenspeed.api.parsers.reading import Cursor, ToolSchemas, json_string_body, strict_loads


def declared_type(schemas: ToolSchemas, function: str, parameter: str) -> str | None:
    properties = schemas.get(function, {}).get("properties", {})
    schema = properties.get(parameter) if isinstance(properties, dict) else None
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def decode_value(raw: str, kind: str | None) -> Any:
    if kind == "string":
        return raw
    text = raw.strip()
    if text in ("True", "False"):  # how Python (and so Qwen3-Coder's template) writes booleans
        return text == "True"
    try:
        return strict_loads(text)
    except ValueError:
        return raw


class ArgumentsWriter:
    """The canonical JSON text of an arguments object, written member by member."""

    def __init__(self) -> None:
        self.members = 0

    def key(self, key: str) -> str:
        opening = "{" if self.members == 0 else ", "
        self.members += 1
        return opening + canonical_json(key) + ": "

    def close(self) -> str:
        return "}" if self.members else "{}"


def read_value(cursor: Cursor, end: str, kind: str | None, events: list[ParsedEvent], *, strip_newline: bool) -> bool:
    """Read a parameter's value up to `end` into argument events; True once the value is complete.

    A string value streams as it arrives (escaped; the closing quote comes with its end), any other value
    is written whole once complete. `strip_newline`: the format puts a newline before `end` (Qwen3-Coder)."""
    value = cursor.until(end)
    if value is not None and strip_newline:
        value = value.removesuffix("\n")
    if kind == "string":
        piece = value if value is not None else cursor.safe_prefix(end, hold="\n" if strip_newline else "")
        text = json_string_body(piece) + ('"' if value is not None else "")
    else:
        text = canonical_json(decode_value(value, kind)) if value is not None else ""
    if text:
        events.append(ToolCallArguments(text))
    return value is not None
