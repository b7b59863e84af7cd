"""DeepSeek-V3 tool calls.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": 1}
    ```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>

DeepSeek-V3.1 and later drop the type and the fence
(`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": 1}<｜tool▁call▁end｜>`); both
decode here. A block decodes only if it is nothing but well-formed calls, so a
malformed one comes back as text instead of being half-used.
"""

from __future__ import annotations

import json
import re

from tokenspeed.api.canonical_json import canonical_json
from tokenspeed.api.parsers.events import ToolCall
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream

START = "<｜tool▁calls▁begin｜>"
END = "<｜tool▁calls▁end｜>"
CALL_START = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_FENCED = re.compile(r"^([^\n]+)\n```(?:json)?\n(.*)\n```\s*$", re.DOTALL)


def _decode_call(head: str, body: str) -> ToolCall | None:
    fenced = _FENCED.match(body)
    if head.strip() == "function" and fenced:
        name, arguments_text = fenced.group(1).strip(), fenced.group(2)
    else:
        name, arguments_text = head.strip(), body
    try:
        arguments = json.loads(arguments_text)
    except ValueError:
        return None
    if not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, canonical_json(arguments))


def decode_block(inner: str) -> list[ToolCall] | None:
    calls: list[ToolCall] = []
    position = 0
    for match in _CALL.finditer(inner):
        if inner[position : match.start()].strip():
            return None  # text between calls: not a clean block
        call = _decode_call(match.group(1), match.group(2))
        if call is None:
            return None
        calls.append(call)
        position = match.end()
    if not calls or inner[position:].strip():
        return None
    return calls


def stream() -> ToolBlockStream:
    return ToolBlockStream(START, END, decode_block)


def forced_prefix(name: str | None) -> str:
    opening = START + CALL_START + "function" + SEP
    return opening if name is None else opening + name + "\n```json\n"
