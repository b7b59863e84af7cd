"""`ServerSettings`: what the HTTP layer is configured with, independent of argparse.

Tests and embedders build it directly; `args.py` builds it from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str] = field(default_factory=lambda: ["embedded"])
    api_key: str | None = None
    tool_call_parser: str | None = None  # a key of parsers.TOOL_FORMATS
    reasoning_parser: str | None = None  # a key of parsers.REASONING_PARSERS
    chat_template: str | None = None  # template text (args.py reads a file path)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
