"""Output parsers chosen by `--tool-call-parser` / `--reasoning-parser`, and the per-completion pipeline."""

from __future__ import annotations

from tokenspeed.api.parsers.events import (
    ParsedEvent,
    ParsedOutput,
    TextPiece,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
)
from tokenspeed.api.parsers.pipeline import OutputParser
from tokenspeed.api.parsers.reading import ToolSchemas
from tokenspeed.api.parsers.reasoning import REASONING_PARSERS
from tokenspeed.api.parsers.registry import TOOL_FORMATS, ToolFormat, tool_format

__all__ = [
    "REASONING_PARSERS",
    "TOOL_FORMATS",
    "OutputParser",
    "ParsedEvent",
    "ParsedOutput",
    "TextPiece",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "ToolFormat",
    "ToolSchemas",
    "tool_format",
]
