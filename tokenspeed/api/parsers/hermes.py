"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Qwen2.5/Qwen3, Hermes and the embedded model write one JSON object per block
(`json_calls.py` reads it, streaming the arguments). We also accept
`"parameters"` for `"arguments"`, arguments given as a JSON string, and a
list of call objects in one block, which smaller models emit.
"""

from __future__ import annotations

from tokenspeed.api.canonical_json import canonical_json
from tokenspeed.api.parsers.json_calls import JsonCallsReader
from tokenspeed.api.parsers.reading import ToolSchemas
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream

START = "<tool_call>"
END = "</tool_call>"


def stream(tools: ToolSchemas) -> ToolBlockStream:
    return ToolBlockStream(START, END, JsonCallsReader)


def forced_prefix(name: str | None) -> str:
    """Output opening that commits the model to a call (of `name`, when given)."""
    if name is None:
        return START + '\n{"name": "'
    return START + "\n" + '{"name": ' + canonical_json(name) + ', "arguments": '
