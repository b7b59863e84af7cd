"""Every tool-call and reasoning format on recorded outputs (`parser_fixtures.py`), streamed and not.

Streaming must agree with parsing the whole text at once whatever the chunking: we split each output at
every single position, character by character, and at many random multi-cut positions (fixed seed).
Tool-call arguments must stream as they are written: a call is announced (name, then argument fragments)
before its block closes, and the fragments concatenate to the canonical arguments.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.parser_fixtures import CASES, CODE, TOOLS, Case
from tokenspeed.api.canonical_json import canonical_json
from tokenspeed.api.parsers import (
    REASONING_PARSERS,
    TOOL_FORMATS,
    OutputParser,
    ParsedEvent,
    ParsedOutput,
    TextPiece,
    ToolCallArguments,
    ToolCallStart,
    tool_format,
)


def parser(case: Case) -> OutputParser:
    tools = tool_format(case.tool_parser) if case.tool_parser else None
    return OutputParser(reasoning_parser=case.reasoning_parser, tool_format=tools, tools=TOOLS)


def stream_events(case: Case, chunks: list[str]) -> list[ParsedEvent]:
    p = parser(case)
    events: list[ParsedEvent] = []
    for chunk in chunks:
        events += p.feed(chunk)
    return events + p.finish()




def check(case: Case, out: ParsedOutput) -> None:
    assert (out.reasoning, out.content) == (case.reasoning, case.content)
    want = [(name, args if isinstance(args, str) else canonical_json(args)) for name, args in case.calls]
    assert [(c.name, c.arguments) for c in out.tool_calls] == want
    assert all(c.complete for c in out.tool_calls)
    if case.call_ids is not None:
        assert [c.call_id for c in out.tool_calls] == case.call_ids
    for call, (_, arguments) in zip(out.tool_calls, case.calls):
        assert json.loads(call.arguments) == arguments  # canonical, and the same value


def test_every_format_and_reasoning_parser_has_a_fixture():
    assert {c.tool_parser for c in CASES} >= set(TOOL_FORMATS)
    assert {c.reasoning_parser for c in CASES} >= set(REASONING_PARSERS)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_whole_output(case):
    check(case, parser(case).parse(case.text))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_streamed_split_anywhere(case):
    whole = parser(case).parse(case.text)
    text = case.text
    for cut in range(len(text) + 1):
        assert ParsedOutput.fold(stream_events(case, [text[:cut], text[cut:]])) == whole, f"split at {cut}"
    by_char = stream_events(case, list(text))
    assert ParsedOutput.fold(by_char) == whole
    assert all(e.text for e in by_char if isinstance(e, TextPiece | ToolCallArguments)), "empty pieces are noise"
    rng = random.Random(17)
    for _ in range(30):
        bounds = sorted({0, len(text), *(rng.randrange(len(text) + 1) for _ in range(rng.randint(1, 12)))})
        chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        assert ParsedOutput.fold(stream_events(case, chunks)) == whole, f"chunks {chunks}"


@pytest.mark.parametrize("case", [c for c in CASES if c.calls], ids=[c.name for c in CASES if c.calls])
def test_calls_are_announced_before_their_arguments_end(case):
    """Fed token-sized pieces, every call starts (with its name) before its last argument fragment, and its
    arguments arrive in several fragments when they are long enough to be written in several tokens."""
    events = stream_events(case, [case.text[i : i + 3] for i in range(0, len(case.text), 3)])
    starts = [i for i, e in enumerate(events) if isinstance(e, ToolCallStart)]
    assert len(starts) == len(case.calls)
    for position, start in enumerate(starts):
        end = starts[position + 1] if position + 1 < len(starts) else len(events)
        fragments = [e for e in events[start + 1 : end] if isinstance(e, ToolCallArguments)]
        assert fragments, "arguments follow their call's start"
        if len("".join(f.text for f in fragments)) > 40:
            assert len(fragments) > 3, "long arguments must stream, not arrive whole"


def test_long_string_argument_streams_before_the_call_is_closed():
    text = "<tool_call>\n<function=write_file>\n<parameter=content>\n" + CODE * 20
    events = OutputParser(tool_format=tool_format("qwen3_coder"), tools=TOOLS).feed(text)
    assert events[0] == ToolCallStart("write_file")
    streamed = "".join(e.text for e in events[1:] if isinstance(e, ToolCallArguments))
    assert streamed.startswith('{"content": "') and json.loads(streamed + '"}')["content"] == (CODE * 20).rstrip("\n")


@pytest.mark.parametrize(
    ("tool_parser", "text"),
    [
        ("hermes", 'x <tool_call>{"name": "a", "arguments": {oops}}</tool_call> y'),
        ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'),
        ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{nope}\n```"
                        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
        ("kimi_k2", "<|tool_calls_section_begin|>not a call<|tool_calls_section_end|>"),
        ("glm45", "<tool_call>\n\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\nplain text, no function\n</tool_call>"),
        ("mistral", "[TOOL_CALLS] no arguments marker here"),
        ("llama3_json", '{"name": 3}'),
        ("openai", "just text, no harmony header"),
    ],
)
def test_text_that_is_not_a_call_comes_back_verbatim(tool_parser, text):
    case = Case("bad", tool_parser, text)
    out = parser(case).parse(text)
    assert out.tool_calls == [] and out.content == text
    assert ParsedOutput.fold(stream_events(case, list(text))) == out


def test_a_call_cut_off_inside_its_arguments_keeps_what_was_written():
    """As OpenAI returns a call cut off by max_tokens: the call, with incomplete arguments."""
    out = OutputParser(tool_format=tool_format("hermes")).parse('<tool_call>\n{"name": "a", "arguments": {"q": "abc')
    (call,) = out.tool_calls
    assert (call.name, call.arguments, call.complete) == ("a", '{"q": "abc', False)


def test_thinking_switched_off_means_no_reasoning_for_template_opened_formats():
    text = "Just the answer."
    on = OutputParser(reasoning_parser="deepseek_r1").parse(text)
    off = OutputParser(reasoning_parser="deepseek_r1", thinking=False).parse(text)
    assert (on.reasoning, on.content) == ("Just the answer.", None)
    assert (off.reasoning, off.content) == (None, "Just the answer.")


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_forced_prefixes_open_a_call_the_parser_reads(name):
    """tool_choice required/named: the opening we append to the prompt, then what a model would write."""
    fmt = tool_format(name)
    continuation = {
        "hermes": '{"city": "Rome"}}\n</tool_call>', "qwen": '{"city": "Rome"}}\n</tool_call>',
        "qwen3_coder": "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
        "deepseek_v3": '{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "kimi_k2": '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>',
        "glm45": "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>",
        "llama3_json": '{"city": "Rome"}}', "mistral": '{"city": "Rome"}', "openai": '{"city": "Rome"}<|call|>',
    }[name]
    out = OutputParser(reasoning_parser="qwen3", tool_format=fmt, forced_prefix=fmt.forced_prefix("get_weather"),
                       tools=TOOLS).parse(continuation)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Rome"}')]
