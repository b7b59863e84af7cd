"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Qwen2.5/Qwen3, Hermes and the embedded model write one JSON object per block.
We also accept `"parameters"` for `"arguments"`, arguments given as a JSON
string, and a list of call objects in one block, which smaller models emit.
"""

from __future__ import annotations

import json
from typing import Any

from tokenspeed.api.canonical_json import canonical_json
from tokenspeed.api.parsers.events import ToolCall
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream

START = "<tool_call>"
END = "</tool_call>"


def _call_from_object(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], canonical_json(arguments))


def decode_block(inner: str) -> list[ToolCall] | None:
    try:
        value = json.loads(inner)
    except ValueError:
        return None
    objects = value if isinstance(value, list) else [value]
    calls = [_call_from_object(obj) for obj in objects]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def stream() -> ToolBlockStream:
    return ToolBlockStream(START, END, decode_block)


def forced_prefix(name: str | None) -> str:
    """Output opening that commits the model to a call (of `name`, when given)."""
    if name is None:
        return START + '\n{"name": "'
    return START + "\n" + '{"name": ' + canonical_json(name) + ', "arguments": '
