"""Tool-call formats by `--tool-call-parser` name.

A format knows how to read calls (`stream`) and how to start one
(`forced_prefix`): `tool_choice` "required" or a named function is honoured
by appending that opening to the prompt, which commits the model to a call
without a grammar engine; the route then checks what it wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenspeed.api.parsers import deepseek_v3, hermes
from tokenspeed.api.parsers.tool_blocks import ToolBlockStream


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    stream: Callable[[], ToolBlockStream]
    forced_prefix: Callable[[str | None], str]


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", hermes.stream, hermes.forced_prefix),
    "qwen": ToolFormat("qwen", hermes.stream, hermes.forced_prefix),  # Qwen2.5/3 write Hermes blocks
    "deepseek_v3": ToolFormat("deepseek_v3", deepseek_v3.stream, deepseek_v3.forced_prefix),
}


def tool_format(name: str) -> ToolFormat:
    return TOOL_FORMATS[name]
