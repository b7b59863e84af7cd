"""JSON schemas as the grammar compiler is given them: length-bounded strings made exact.

xgrammar 0.2 compiles a string with `minLength`/`maxLength` (and no
`pattern`) to a character loop that admits raw control characters and byte
sequences that are not UTF-8, so a weak model could emit `"\\u0005"` unescaped
(not JSON) or a broken character (the client counts a different length).
Such a string is given instead as the equivalent `pattern` over printable
characters (escapes are the grammar's job: the pattern constrains the
decoded value), which xgrammar compiles exactly. Everything else passes
through unchanged, nested schemas included (`properties`, `items`, `$defs`,
`anyOf`, ... are all reached by walking every object in the schema).
"""

from __future__ import annotations

import copy
from typing import Any

# Printable characters: no C0 controls, no DEL..NBSP controls, no lone surrogates.
_CHARACTER = r"[\x20-\x7e\u00a0-\ud7ff\ue000-\uffff]"
_EXACT_ALREADY = ("pattern", "format", "enum", "const")


def exact_string_lengths(schema: Any) -> Any:
    """A copy of `schema` whose length-bounded strings are patterns (see the module docstring)."""
    schema = copy.deepcopy(schema)
    _walk(schema)
    return schema


def _walk(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item)
        return
    if not isinstance(node, dict):
        return
    if _is_bounded_string(node):
        low = node.pop("minLength", 0)
        high = node.pop("maxLength", None)
        node["pattern"] = f"^{_CHARACTER}{{{low},{'' if high is None else high}}}$"
    for value in node.values():
        _walk(value)


def _is_bounded_string(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return (
        (kind == "string" or kind == ["string"])
        and ("minLength" in node or "maxLength" in node)
        and isinstance(node.get("minLength", 0), int)
        and isinstance(node.get("maxLength", 0), int)
        and not any(key in node for key in _EXACT_ALREADY)
    )


def exact_structural_tag(tag: Any) -> Any:
    """`exact_string_lengths` applied to every JSON-schema element of a structural tag."""
    tag = copy.deepcopy(tag)
    _walk_tag(tag)
    return tag


def _walk_tag(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _walk_tag(item)
    elif isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            node["json_schema"] = exact_string_lengths(node["json_schema"])
            return
        for value in node.values():
            _walk_tag(value)
