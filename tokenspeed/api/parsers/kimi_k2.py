"""Kimi-K2 tool calls (its chat template and model card describe them).

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The header is the call's id, `functions.NAME:INDEX`; we return it as the
call id (Kimi's template renders tool calls and results by that id, so it
must come back unchanged for the next turn to render as the model wrote it).
"""

from __future__ import annotations

import re

from tokenspeed.api.parsers.marked_calls import MarkedCallsReader
from tokenspeed.api.parsers.reading import ToolSchemas
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream

START = "<|tool_calls_section_begin|>"
END = "<|tool_calls_section_end|>"
CALL_START = "<|tool_call_begin|>"
ARGUMENTS = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (START, END, CALL_START, ARGUMENTS, CALL_END)

_ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")


def read_header(header: str, preamble: str) -> tuple[str, str | None] | None:
    call_id = header.strip()
    match = _ID.fullmatch(call_id)
    if match is None or preamble.strip():
        return None
    return match.group(1), call_id


def stream(tools: ToolSchemas) -> ToolBlockStream:
    return ToolBlockStream(START, END, lambda: MarkedCallsReader(CALL_START, ARGUMENTS, CALL_END, read_header))


def forced_prefix(name: str | None) -> str:
    opening = START + CALL_START + "functions."
    return opening if name is None else opening + name + ":0" + ARGUMENTS
