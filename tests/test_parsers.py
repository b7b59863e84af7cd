"""Tool-call and reasoning parsers: formats, normalisation, and streaming == non-streaming."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.api.canonical_json import arguments_for_template, canonical_json
from tokenspeed.api.parsers import (
    REASONING_PARSERS,
    TOOL_FORMATS,
    OutputParser,
    ParsedOutput,
    TextPiece,
    ToolCall,
    tool_format,
)
from tokenspeed.api.parsers import deepseek_v3 as ds
from tokenspeed.api.parsers.events import partial_marker_len

HERMES = tool_format("hermes")
DEEPSEEK = tool_format("deepseek_v3")


SCHEMAS = {"f": {"properties": {"a": {"type": "string"}}}}  # typed parameters stream as they are written


def parse(text: str, *, reasoning: str | None = None, tools=HERMES, forced: str = "") -> ParsedOutput:
    return OutputParser(reasoning_parser=reasoning, tool_format=tools, forced_prefix=forced,
                        tools=SCHEMAS).parse(text)


def stream_parse(chunks: list[str], **kwargs) -> ParsedOutput:
    parser = OutputParser(
        reasoning_parser=kwargs.get("reasoning"), tool_format=kwargs.get("tools", HERMES),
        forced_prefix=kwargs.get("forced", ""), tools=SCHEMAS,
    )
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    assert all(not isinstance(e, TextPiece) or e.text for e in events), "empty text pieces are noise"
    return ParsedOutput.fold(events)


# ---- Hermes / Qwen ------------------------------------------------------------------------------


def test_hermes_single_call_drops_separating_whitespace():
    out = parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert out.content == "Let me check."
    assert out.tool_calls == [ToolCall("get_weather", '{"city": "Paris"}')]


def test_hermes_several_calls_and_no_content():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "parameters": {"y": [1, 2]}}\n</tool_call>\n'
    )
    out = parse(text)
    assert out.content is None
    assert [c.name for c in out.tool_calls] == ["a", "b"]
    assert out.tool_calls[1].arguments == '{"y": [1, 2]}'


def test_hermes_arguments_given_as_a_json_string_and_lists_of_calls():
    out = parse('<tool_call>[{"name": "a", "arguments": "{\\"k\\": \\"é\\"}"}, {"name": "b"}]</tool_call>')
    assert out.tool_calls == [ToolCall("a", '{"k": "é"}'), ToolCall("b", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        'x <tool_call>{"name": "a", "arguments": {oops}}</tool_call> y',
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # arguments not an object
        'tail <tool_call>{"name": "a", "argu',  # cut off inside a call
        "a < b and <tool_ca",  # a partial marker at the very end
        "plain text\n\n  ",
    ],
)
def test_hermes_text_that_is_not_a_call_is_returned_verbatim(text):
    out = parse(text)
    assert out.tool_calls == [] and out.content == text
    assert stream_parse(list(text)).content == text


def test_hermes_unclosed_but_complete_call_at_end_of_output_is_a_call():
    out = parse('<tool_call>\n{"name": "a", "arguments": {"q": 1}}\n')
    assert out.tool_calls == [ToolCall("a", '{"q": 1}')] and out.content is None


def test_forced_prefixes_continue_into_calls():
    hermes = parse('{"city": "Rome"}}\n</tool_call>', forced=HERMES.forced_prefix("get_weather"))
    assert hermes.tool_calls == [ToolCall("get_weather", '{"city": "Rome"}')]
    hermes_any = parse('lookup", "arguments": {}}\n</tool_call>', forced=HERMES.forced_prefix(None))
    assert hermes_any.tool_calls == [ToolCall("lookup", "{}")]
    deepseek = parse(
        '{"city": "Rome"}\n```' + ds.CALL_END + ds.END, tools=DEEPSEEK, forced=DEEPSEEK.forced_prefix("get_weather")
    )
    assert deepseek.tool_calls == [ToolCall("get_weather", '{"city": "Rome"}')]


def test_forced_prefix_disables_reasoning_parsing():
    out = parse('{"a": 1}}</tool_call>', reasoning="deepseek_r1", forced=HERMES.forced_prefix("f"))
    assert out.reasoning is None and out.tool_calls == [ToolCall("f", '{"a": 1}')]


# ---- DeepSeek-V3 --------------------------------------------------------------------------------


def _v3_call(name: str, args: str) -> str:
    return f"{ds.CALL_START}function{ds.SEP}{name}\n```json\n{args}\n```{ds.CALL_END}"


def test_deepseek_v3_calls():
    text = "Sure." + ds.START + _v3_call("a", '{"x":1}') + "\n" + _v3_call("b", "{}") + ds.END
    out = parse(text, tools=DEEPSEEK)
    assert out.content == "Sure."
    assert out.tool_calls == [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]


def test_deepseek_v31_calls_without_type_and_fence():
    text = ds.START + f'{ds.CALL_START}search{ds.SEP}{{"q": "x"}}{ds.CALL_END}' + ds.END
    assert parse(text, tools=DEEPSEEK).tool_calls == [ToolCall("search", '{"q": "x"}')]


def test_deepseek_malformed_block_is_text():
    text = ds.START + _v3_call("a", "{not json}") + ds.END
    out = parse(text, tools=DEEPSEEK)
    assert out.tool_calls == [] and out.content == text


# ---- reasoning ----------------------------------------------------------------------------------


def test_qwen3_reasoning_is_split_and_normalised():
    out = parse("<think>\nStep 1.\n\nStep 2.\n</think>\n\nThe answer.", reasoning="qwen3", tools=None)
    assert (out.reasoning, out.content) == ("Step 1.\n\nStep 2.", "The answer.")


def test_qwen3_without_think_is_all_content_verbatim():
    text = "  No thinking here </think> at all"
    out = parse(text, reasoning="qwen3", tools=None)
    assert (out.reasoning, out.content) == (None, text)


def test_deepseek_r1_starts_inside_reasoning():
    out = parse("I should add.\n</think>\n\n4", reasoning="deepseek_r1", tools=None)
    assert (out.reasoning, out.content) == ("I should add.", "4")
    cut = parse("<think>still thinking", reasoning="deepseek_r1", tools=None)
    assert (cut.reasoning, cut.content) == ("still thinking", None)


def test_tool_call_inside_reasoning_is_not_a_call():
    text = '<think>maybe <tool_call>{"name": "a"}</tool_call></think>ok<tool_call>{"name": "b"}</tool_call>'
    out = parse(text, reasoning="qwen3")
    assert out.reasoning == 'maybe <tool_call>{"name": "a"}</tool_call>'
    assert out.content == "ok" and out.tool_calls == [ToolCall("b", "{}")]


# ---- streaming equals non-streaming ------------------------------------------------------------

_FRAGMENTS = [
    "<think>", "</think>", "\n", "\n\n", " ", "hello", "é€", "<tool_call>", "</tool_call>", "<tool", "_call>",
    '{"name": "f", "arguments": {"a": 1}}', '{"name": "g"}', "{bad", "</", "<", ds.START, ds.END,
    _v3_call("h", '{"z": true}'), ds.CALL_START, '{"x": [1, 2.50, "\\u00e9"]}', "}", '"', ",",
    "<function=f>", "<parameter=a>", "</parameter>", "</function>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "[TOOL_CALLS]", "[ARGS]", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
    "functions.f:0", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|channel|>analysis", "<|message|>",
    "<|end|>", "<|start|>assistant", "<|channel|>final", " to=functions.f", "<|call|>", "[THINK]", "[/THINK]",
]
_TOOLS = [None, *(tool_format(name) for name in sorted(TOOL_FORMATS))]


@settings(max_examples=500, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_FRAGMENTS), max_size=14),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
    reasoning=st.sampled_from([None, *sorted(REASONING_PARSERS)]),
    tools=st.sampled_from(_TOOLS),
)
def test_streaming_in_any_chunks_equals_parsing_at_once(pieces, cuts, reasoning, tools):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = parse(text, reasoning=reasoning, tools=tools)
    assert stream_parse(chunks, reasoning=reasoning, tools=tools) == whole
    if reasoning is None and not whole.tool_calls and (tools is None or not tools.reads_reasoning):
        assert (whole.content or "") == text  # no call found: nothing was dropped or altered


def test_partial_marker_len():
    assert partial_marker_len("abc<tool", "<tool_call>") == 5
    assert partial_marker_len("abc", "<tool_call>") == 0
    assert partial_marker_len("<tool_call>", "<tool_call>") == 0  # a whole marker is not partial


# ---- canonical arguments ------------------------------------------------------------------------


def test_arguments_for_template_parses_objects_and_keeps_other_strings():
    assert arguments_for_template('{"b":1,  "a":"é"}') == {"b": 1, "a": "é"}
    assert arguments_for_template("not json") == "not json"
    assert arguments_for_template("[1, 2]") == "[1, 2]"
    assert arguments_for_template(None) == {}
    assert canonical_json({"b": 1, "a": "é"}) == '{"b": 1, "a": "é"}' == json.dumps({"b": 1, "a": "é"}, ensure_ascii=False)
