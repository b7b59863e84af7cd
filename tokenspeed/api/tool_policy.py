"""How a request's `tools` / `tool_choice` shape its prompt and the parsing of its output.

Tools are always rendered into the prompt when given, whatever `tool_choice`
says, so that switching `tool_choice` between turns never changes the prompt
prefix. Then:

* `none`: the output is returned as text, unparsed;
* `auto`: calls are parsed out of the output with the server's tool parser;
* `required` / a named function: enforced by a grammar over the parser's
  call format (`tool_grammar.py`: hermes, qwen, llama3_json, mistral,
  deepseek_v3, kimi_k2), so the output is a call (of that function) whatever
  the model would have written; reasoning parsing is then off, as the
  output starts with the call. A call cut short by `max_tokens` comes back
  as far as it got (finish_reason "length"), never as an error. Formats
  without a grammar (qwen3_coder, glm45, openai) are steered through the
  prompt instead: the opening of a call in the model's own format is
  appended after the generation prompt, and the result is checked: no valid
  call (of the right function) is a 500 `invalid_model_output`, never a
  silent text answer.

`CallFilter` applies the policy to a completion's parser events: call ids in
the shape the model's template accepts, and `parallel_tool_calls=false`
(calls after the first are dropped, streaming as when not).

Shared by the OpenAI, Anthropic and Responses routes (Anthropic's
`any`/`tool` map to `required`/named).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from tokenspeed.api.errors import model_output_error
from tokenspeed.api.parsers import (
    TOOL_FORMATS,
    OutputParser,
    ParsedEvent,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolFormat,
    ToolSchemas,
)
from tokenspeed.api.parsers.registry import default_call_id
from tokenspeed.api.tool_grammar import tool_call_grammar
from tokenspeed.errors import InvalidRequest
from tokenspeed.scheduler.structured_outputs import StructuredOutputsParams

ToolChoice = str | None  # "none" | "auto" | "required" | None; a named function goes in `function`


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    tool_format: ToolFormat | None = None  # None: do not parse calls
    forced_prefix: str = ""
    required: bool = False
    function: str | None = None
    tool_names: frozenset[str] = frozenset()
    parallel: bool = True
    schemas: ToolSchemas = field(default_factory=dict)  # name -> parameters, for formats that type values by them
    grammar: StructuredOutputsParams | None = None  # enforces required/named (None: prompt-steered, or not forced)

    def output_parser(self, reasoning_parser: str | None, *, thinking: bool = True) -> OutputParser:
        return OutputParser(
            reasoning_parser=None if self.grammar is not None else reasoning_parser,
            tool_format=self.tool_format, forced_prefix=self.forced_prefix, tools=self.schemas, thinking=thinking,
        )

    def calls(self, id_prefix: str) -> CallFilter:
        return CallFilter(self, id_prefix)

    def check(self, calls: list[ToolCall]) -> None:
        """Enforce `required`/named on the calls of a finished output (a grammar already did)."""
        if not self.required or self.grammar is not None:
            return
        if not calls:
            raise model_output_error("tool_choice requires a tool call, but the model did not write a valid one.")
        for call in calls:
            if not call.complete:
                raise model_output_error(f"The model's call of {call.name!r} has no valid JSON arguments.")
            if self.function is not None and call.name != self.function:
                raise model_output_error(f"tool_choice names {self.function!r}, but the model called {call.name!r}.")
            if call.name not in self.tool_names:
                raise model_output_error(f"The model called {call.name!r}, which is not among the tools.")


def tool_policy(
    tools: list[dict[str, Any]] | None,
    choice: ToolChoice,
    function: str | None,
    *,
    parser_name: str | None,
    parallel: bool = True,
    token_markers: Collection[str] = (),
) -> ToolPolicy:
    """`token_markers`: the tokenizer's added tokens (a grammar matches those markers as tokens)."""
    names = frozenset(t["function"]["name"] for t in tools or [])
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
    forcing = choice == "required" or function is not None
    if not tools:
        if forcing:
            raise InvalidRequest("tool_choice requires a tool call but the request has no tools.")
        return ToolPolicy()
    if choice == "none":
        return ToolPolicy(tool_names=names)
    if parser_name is None:
        raise InvalidRequest(
            "This request asks for tool calls, but the server has no tool-call parser; "
            "start it with --tool-call-parser (or send tool_choice='none')."
        )
    tool_format = TOOL_FORMATS[parser_name]
    if function is not None and function not in names:
        raise InvalidRequest(f"tool_choice names {function!r}, which is not among the tools.")
    if not forcing:
        return ToolPolicy(tool_format, tool_names=names, parallel=parallel, schemas=schemas)
    grammar = tool_call_grammar(parser_name, tools, function, parallel=parallel, token_markers=token_markers)
    if grammar is not None:
        return ToolPolicy(tool_format, required=True, function=function, tool_names=names, parallel=parallel,
                          schemas=schemas, grammar=grammar)
    return ToolPolicy(
        tool_format,
        forced_prefix=tool_format.forced_prefix(function),
        required=True,
        function=function,
        tool_names=names,
        parallel=parallel,
        schemas=schemas,
    )


class CallFilter:
    """A completion's parser events as the routes send them: every call gets an id (the model's own, else one
    in the shape its template accepts, with the API's prefix), and with `parallel_tool_calls=false` calls
    after the first are dropped. `calls` folds what was let through."""

    def __init__(self, policy: ToolPolicy, id_prefix: str) -> None:
        self._policy = policy
        self._prefix = id_prefix
        self._dropping = False
        self.calls: list[ToolCall] = []

    def __call__(self, events: list[ParsedEvent]) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        for event in events:
            if isinstance(event, ToolCallStart):
                self._dropping = bool(self.calls) and not self._policy.parallel
                if self._dropping:
                    continue
                new_id = self._policy.tool_format.new_call_id if self._policy.tool_format else default_call_id
                event = ToolCallStart(event.name, event.call_id or new_id(self._prefix))
                self.calls.append(ToolCall(event.name, "", event.call_id))
            elif isinstance(event, ToolCallArguments):
                if self._dropping:
                    continue
                self.calls[-1].arguments += event.text
            out.append(event)
        return out

    def check(self) -> None:
        self._policy.check(self.calls)
