"""Grammars that make `tool_choice` "required" / a named function hold whatever the model writes.

For each tool-call format whose calls carry their arguments as JSON or as
typed XML parameters, the grammar is the format's own syntax with the tool's
parameter schema in the arguments' place, written as an xgrammar structural
tag (`StructuredOutputsParams.structural_tag`):

| `--tool-call-parser` | one call | between calls |
|---|---|---|
| `hermes`, `qwen` | `<tool_call>\\n{"name": "f", "arguments": ARGS}\\n</tool_call>` | `\\n` |
| `llama3_json` | `{"name": "f", "parameters": ARGS}` | `; ` |
| `mistral` | `[TOOL_CALLS]f[ARGS]ARGS` | |
| `deepseek_v3` | `<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`, inside `<｜tool▁calls▁begin｜>`...`<｜tool▁calls▁end｜>` | |
| `kimi_k2` | `<|tool_call_begin|>functions.f:N<|tool_call_argument_begin|>ARGS<|tool_call_end|>`, inside `<|tool_calls_section_begin|>`...`<|tool_calls_section_end|>` | |

`required` allows one or more calls of any tool (exactly one with
`parallel_tool_calls=false`), a named function exactly that function. The
output is then a valid call by construction: no 500 for a model that would
not comply, and no opening forced into the prompt, so the prompt is the same
whatever `tool_choice` says (prefix-cache friendly). `qwen3_coder`, `glm45`
(XML parameters: xgrammar's XML styles do not bound the blanks around raw
values, so a weak model can pad them forever) and `openai` (harmony) have no
grammar here; for them the route still forces the call's opening into the
prompt and checks the result (`tool_policy.py`).

A marker the tokenizer holds as one added token (`<tool_call>` in Qwen,
`[TOOL_CALLS]` in Mistral) is matched as that token, so the model writes it
as it was trained to; other text is matched as text. JSON arguments are
written with at most one blank in a row, which keeps a call finite whatever
the weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from tokenspeed.scheduler.structured_outputs import StructuredOutputsParams

_INDEX = object()  # stands for a call index (kimi_k2 ids): digits
Piece = str | object


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """One call is `head(name)`, the JSON arguments, then `tail`."""

    head: Callable[[str], list[Piece]]
    tail: str
    separator: str = ""
    section: tuple[str, str] = ("", "")


def _name(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)


CALL_SYNTAX: dict[str, CallSyntax] = {
    "hermes": CallSyntax(lambda n: ['<tool_call>\n{"name": ' + _name(n) + ', "arguments": '], "}\n</tool_call>", "\n"),
    "llama3_json": CallSyntax(lambda n: ['{"name": ' + _name(n) + ', "parameters": '], "}", "; "),
    "mistral": CallSyntax(lambda n: ["[TOOL_CALLS]" + n + "[ARGS]"], ""),
    "deepseek_v3": CallSyntax(
        lambda n: ["<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + n + "\n```json\n"], "\n```<｜tool▁call▁end｜>",
        section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    ),
    "kimi_k2": CallSyntax(
        lambda n: ["<|tool_call_begin|>functions." + n + ":", _INDEX, "<|tool_call_argument_begin|>"],
        "<|tool_call_end|>", section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    ),
}
CALL_SYNTAX["qwen"] = CALL_SYNTAX["hermes"]  # Qwen2.5/3 write Hermes blocks


def tool_call_grammar(
    parser_name: str,
    tools: list[dict[str, Any]],
    function: str | None,
    *,
    parallel: bool,
    token_markers: Collection[str] = (),
) -> StructuredOutputsParams | None:
    """The grammar of "call `function`" (None: any of `tools`, at least one) in `parser_name`'s format;
    None when that format has no grammar. `token_markers`: the tokenizer's added tokens."""
    syntax = CALL_SYNTAX.get(parser_name)
    if syntax is None:
        return None
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    names = [function] if function is not None else list(schemas)
    text = _TextPieces(token_markers)
    alternatives = [_call(syntax, name, schemas[name], text) for name in names]
    one = alternatives[0] if len(alternatives) == 1 else {"type": "or", "elements": alternatives}
    calls = one
    if parallel and function is None:
        more = [*text(syntax.separator), one] if syntax.separator else [one]
        calls = {"type": "sequence", "elements": [one, {"type": "star", "content": _sequence(more)}]}
    begin, end = syntax.section
    body = _sequence([*text(begin), calls, *text(end)])
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": body}))


def _call(syntax: CallSyntax, name: str, schema: dict[str, Any], text: _TextPieces) -> dict[str, Any]:
    elements: list[dict[str, Any]] = []
    for piece in syntax.head(name):
        if piece is _INDEX:
            elements.append({"type": "regex", "pattern": "[0-9]{1,3}"})
        else:
            assert isinstance(piece, str)
            elements.extend(text(piece))
    elements.append({"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1})
    elements.extend(text(syntax.tail))
    return _sequence(elements)


def _sequence(elements: list[dict[str, Any]]) -> dict[str, Any]:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


class _TextPieces:
    """Literal text as structural-tag elements: each added-token marker in it becomes that token."""

    def __init__(self, token_markers: Collection[str]) -> None:
        # Longest first, so `<tool_call>` is not read as a shorter marker it contains.
        self._markers = sorted((m for m in token_markers if m), key=len, reverse=True)

    def __call__(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while text:
            found = min(
                ((text.find(m), m) for m in self._markers if m in text), key=lambda hit: (hit[0], -len(hit[1])),
                default=None,
            )
            if found is None:
                out.append({"type": "const_string", "value": text})
                break
            at, marker = found
            if at:
                out.append({"type": "const_string", "value": text[:at]})
            out.append({"type": "token", "token": marker})
            text = text[at + len(marker):]
        return out
