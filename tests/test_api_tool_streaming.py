"""Tool calls over HTTP as the official clients consume them: streamed incrementally, parallel or not.

OpenAI streams a call as a first `tool_calls` delta carrying index, id and
name, then argument fragments under the same index; Anthropic as a
`tool_use` block start followed by `input_json_delta`s. Both must
concatenate to exactly the non-streamed answer. Runs against the scripted
engine of `test_api_routes.py` (the embedded model cannot be made to call).
"""

from __future__ import annotations

import pytest

from tests.test_api_routes import WEATHER, Script, make, user
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.models.embedded.materialize import embedded_model_path

pytestmark = pytest.mark.anyio

CALLS = ['Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', 'ty": "Par', 'is", "days"', ": 3}}\n</tool_call>",
         '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>']
PARIS, ROME = '{"city": "Paris", "days": 3}', '{"city": "Rome"}'


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


async def _streamed_calls(oai, **kwargs) -> tuple[list, str | None]:
    entries, finish = [], None
    async for chunk in await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER],
                                                          stream=True, **kwargs):
        entries += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return entries, finish


async def test_openai_streams_id_and_name_first_then_argument_fragments(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    engine.scripts = [Script(CALLS), Script(CALLS)]
    whole = (await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER])).choices[0]
    entries, finish = await _streamed_calls(oai)
    assert finish == whole.finish_reason == "tool_calls"
    for index, arguments in enumerate([PARIS, ROME]):
        mine = [e for e in entries if e.index == index]
        first, rest = mine[0], mine[1:]
        assert first.id.startswith("call_") and first.type == "function"
        assert first.function.name == "get_weather" and first.function.arguments == ""
        assert all(e.id is None and e.function.name is None for e in rest)
        assert "".join(e.function.arguments for e in rest) == arguments == whole.message.tool_calls[index].function.arguments
    assert len([e for e in entries if e.index == 0]) > 3, "the first call's arguments arrive in several deltas"
    assert entries[0].id != [e for e in entries if e.index == 1][0].id


async def test_parallel_tool_calls_false_returns_one_call_streamed_or_not(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    engine.scripts = [Script(CALLS), Script(CALLS)]
    whole = await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER],
                                              parallel_tool_calls=False)
    assert [c.function.arguments for c in whole.choices[0].message.tool_calls] == [PARIS]
    entries, _ = await _streamed_calls(oai, parallel_tool_calls=False)
    assert {e.index for e in entries} == {0}
    assert "".join(e.function.arguments for e in entries) == PARIS


async def test_anthropic_streams_tool_use_input_as_json_deltas(tokenizer):
    engine, _, _, ant = make(tokenizer)
    engine.scripts = [Script(CALLS), Script(CALLS), Script(CALLS)]
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    kwargs = {"model": "embedded", "max_tokens": 50, "tools": tools, "messages": user("Weather?")}
    whole = await ant.messages.create(**kwargs)
    async with ant.messages.stream(**kwargs) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert [(s.content_block.name, s.content_block.input) for s in starts] == [("get_weather", {})] * 2
    first_block = [e for e in events if e.type == "content_block_delta" and e.index == starts[0].index]
    assert len(first_block) == 3 and "".join(e.delta.partial_json for e in first_block) == PARIS
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"}) for b in whole.content]
    assert [b.input for b in whole.content if b.type == "tool_use"] == [{"city": "Paris", "days": 3}, {"city": "Rome"}]
    one = await ant.messages.create(**kwargs, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.type for b in one.content] == ["text", "tool_use"]


async def test_markers_the_tokenizer_hides_are_kept_and_the_stop_token_cut():
    """Harmony's markers are special tokens in gpt-oss's tokenizer: the server decodes with them kept, and the
    stop token that ended the output (here `<|call|>`) is no part of the answer."""
    special = load_tokenizer(embedded_model_path())
    special.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>", "<|call|>", "<|end|>",
                                                              "<|start|>", "<|constrain|>", "<|return|>"]})
    call = special.convert_tokens_to_ids("<|call|>")
    engine, _, oai, _ = make(special, tool_call_parser="openai", reasoning_parser=None)
    output = ["<|channel|>analysis<|message|>Use the tool.<|end|>", "<|start|>assistant<|channel|>commentary ",
              'to=functions.get_weather <|constrain|>json<|message|>{"city":', ' "Paris"}<|call|>']
    engine.scripts = [Script(output, stop_reason=call), Script(["plain"])]
    out = (await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER])).choices[0]
    assert engine.requests[0].params.skip_special_tokens is False
    assert out.message.reasoning_content == "Use the tool."  # harmony carries its reasoning, parser or not
    assert [(c.function.name, c.function.arguments) for c in out.message.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER], tool_choice="none")
    assert engine.requests[1].params.skip_special_tokens is True  # nothing is parsed: nothing to keep


async def test_special_tokens_stay_hidden_when_the_parsers_can_read_them_anyway(tokenizer):
    engine, _, oai, _ = make(tokenizer, tool_call_parser="hermes")
    await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER])
    assert engine.requests[0].params.skip_special_tokens is True
