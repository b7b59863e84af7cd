"""Tool-call formats by `--tool-call-parser` name (vLLM's names).

A format knows how to read calls (`stream`, given the request's tool
schemas), how to start one (`forced_prefix`), which markers its syntax uses
(`markers`: when the model's tokenizer hides any of them as special tokens,
outputs are decoded with special tokens kept) and what its call ids look
like. `tool_choice` "required" or a named function is honoured by appending
the opening to the prompt, which commits the model to a call without a
grammar engine; the route then checks what it wrote.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenspeed.api.parsers import (
    deepseek_v3,
    glm45,
    harmony,
    hermes,
    kimi_k2,
    llama3_json,
    mistral,
    qwen3_coder,
)
from tokenspeed.api.parsers.events import ParserStage
from tokenspeed.api.parsers.reading import ToolSchemas


def default_call_id(prefix: str) -> str:
    return (prefix + uuid.uuid4().hex)[:29]


def _mistral_call_id(prefix: str) -> str:
    return uuid.uuid4().hex[:9]  # Mistral's templates refuse any other shape


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    stream: Callable[[ToolSchemas], ParserStage]
    forced_prefix: Callable[[str | None], str]
    markers: tuple[str, ...] = ()
    new_call_id: Callable[[str], str] = field(default=default_call_id)  # argument: the API's id prefix
    reads_reasoning: bool = False  # the format also carries the reasoning (harmony): no reasoning parser runs


TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat("hermes", hermes.stream, hermes.forced_prefix, (hermes.START, hermes.END)),
        # Qwen2.5/3 write Hermes blocks
        ToolFormat("qwen", hermes.stream, hermes.forced_prefix, (hermes.START, hermes.END)),
        ToolFormat("qwen3_coder", qwen3_coder.stream, qwen3_coder.forced_prefix, qwen3_coder.MARKERS),
        ToolFormat("deepseek_v3", deepseek_v3.stream, deepseek_v3.forced_prefix, deepseek_v3.MARKERS),
        ToolFormat("kimi_k2", kimi_k2.stream, kimi_k2.forced_prefix, kimi_k2.MARKERS),
        ToolFormat("glm45", glm45.stream, glm45.forced_prefix, glm45.MARKERS),
        ToolFormat("llama3_json", llama3_json.stream, llama3_json.forced_prefix),
        ToolFormat("mistral", mistral.stream, mistral.forced_prefix, mistral.MARKERS, _mistral_call_id),
        ToolFormat("openai", harmony.stream, harmony.forced_prefix, harmony.MARKERS, reads_reasoning=True),
    )
}


def tool_format(name: str) -> ToolFormat:
    return TOOL_FORMATS[name]
