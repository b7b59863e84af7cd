"""DeepSeek-V3 tool calls.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": 1}
    ```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>

DeepSeek-V3.1 and later drop the type and the fence
(`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": 1}<｜tool▁call▁end｜>`); both
decode here (`marked_calls.py` streams the arguments).
"""

from __future__ import annotations

import re

from tokenspeed.api.parsers.marked_calls import MarkedCallsReader
from tokenspeed.api.parsers.reading import ToolSchemas
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream

START = "<｜tool▁calls▁begin｜>"
END = "<｜tool▁calls▁end｜>"
CALL_START = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
MARKERS = (START, END, CALL_START, CALL_END, SEP)

_FENCE = re.compile(r"\s*(?:```(?:json)?\s*)?")


def read_header(header: str, preamble: str) -> tuple[str, str | None] | None:
    if header.strip() == "function" and preamble.strip():  # V3: the name is on the line after the separator
        name, _, fence = preamble.partition("\n")
        return (name.strip(), None) if name.strip() and _FENCE.fullmatch(fence) else None
    return (header.strip(), None) if header.strip() and not preamble.strip() else None


def stream(tools: ToolSchemas) -> ToolBlockStream:
    return ToolBlockStream(START, END, lambda: MarkedCallsReader(CALL_START, SEP, CALL_END, read_header))


def forced_prefix(name: str | None) -> str:
    opening = START + CALL_START + "function" + SEP
    return opening if name is None else opening + name + "\n```json\n"
