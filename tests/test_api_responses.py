"""`/v1/responses` through the official OpenAI client, against the scripted engine.

Covers what a specific output is needed for: reasoning, text and
function-call items and their stream events (checked by the SDK's own
`responses.stream()` accumulator, which refuses an inconsistent event
sequence), `previous_response_id` rendering the conversation byte-stably,
the store's bound, `store: false`, GET / DELETE, and the 400s. The live
server test (`test_api_responses_live.py`) runs the real engine.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.test_api_routes import CALL_TEXT, WEATHER, Script, make
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.models.embedded.materialize import embedded_model_path

pytestmark = pytest.mark.anyio

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER["function"]["parameters"]}
REPLY = ["<think>\nplan\n</think>\n\n", "Calling", " now.", *(CALL_TEXT[i : i + 8] for i in range(0, len(CALL_TEXT), 8))]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


def _summary(response) -> list[tuple]:
    out = []
    for item in response.output:
        if item.type == "function_call":
            out.append((item.type, item.name, item.arguments, item.status))
        else:
            out.append((item.type, "".join(part.text for part in item.content), item.status))
    return out


async def test_create_streamed_and_not_give_the_same_items(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    engine.scripts = [Script(REPLY), Script(REPLY), Script(REPLY)]
    whole = await oai.responses.create(model="embedded", input="Weather in Paris?", tools=[TOOL],
                                       instructions="Be brief.", max_output_tokens=64, temperature=0.5)
    assert whole.status == "completed" and whole.output_text == "Calling now."
    assert _summary(whole) == [("reasoning", "plan", "completed"), ("message", "Calling now.", "completed"),
                               ("function_call", "get_weather", '{"city": "Paris"}', "completed")]
    call = whole.output[2]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    params = engine.requests[0].params
    assert (params.max_tokens, params.temperature) == (64, 0.5)
    assert whole.usage.input_tokens == len(engine.requests[0].prompt)
    assert whole.usage.input_tokens_details.cached_tokens == 4 and whole.usage.output_tokens_details.reasoning_tokens > 0
    assert (whole.instructions, whole.tools[0].name, whole.store) == ("Be brief.", "get_weather", True)

    kinds = [event.type async for event in await oai.responses.create(
        model="embedded", input="Weather in Paris?", tools=[TOOL], instructions="Be brief.", stream=True)]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for needed in ("response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                   "response.output_text.delta", "response.output_text.done", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"):
        assert needed in kinds
    assert kinds.count("response.function_call_arguments.delta") > 1, "arguments stream in fragments"

    async with oai.responses.stream(model="embedded", input="Weather in Paris?", tools=[TOOL],
                                    instructions="Be brief.") as stream:
        numbers = [event.sequence_number async for event in stream]
        final = await stream.get_final_response()
    assert numbers == list(range(len(numbers)))
    assert _summary(final) == _summary(whole)


async def test_previous_response_id_continues_the_conversation_byte_stably(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    engine.scripts = [Script(REPLY), Script(["It is sunny."]), Script(["Bye."])]
    first = await oai.responses.create(model="embedded", input="Weather in Paris?", tools=[TOOL])
    call = first.output[-1]
    second = await oai.responses.create(
        model="embedded", previous_response_id=first.id, tools=[TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    before, after = engine.requests[0].prompt, engine.requests[1].prompt
    assert after[: len(before)] == before
    rendered = tokenizer.decode(after[len(before):], skip_special_tokens=False)
    assert rendered.startswith("<think>\nplan\n</think>\n\nCalling now.\n" + CALL_TEXT + "<|im_end|>")
    assert "sunny, 21 C" in rendered
    # the same turn sent back as items (no store needed) renders to the same prompt
    items = [item.model_dump(exclude_none=True) for item in first.output]
    await oai.responses.create(model="embedded", tools=[TOOL], store=False, input=[
        {"role": "user", "content": "Weather in Paris?"}, *items,
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert engine.requests[2].prompt == after


async def test_store_get_delete_and_the_lru_bound(tokenizer):
    engine, _, oai, _ = make(tokenizer, max_stored_responses=2)
    ids = [(await oai.responses.create(model="embedded", input=f"q{i}")).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(ids[0])  # least recently used, dropped
    got = await oai.responses.retrieve(ids[2])
    assert got.id == ids[2] and got.output_text == "ok"
    await oai.responses.delete(ids[2])
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(ids[2])
    with pytest.raises(openai.NotFoundError):
        await oai.responses.delete(ids[2])
    unstored = await oai.responses.create(model="embedded", input="x", store=False)
    with pytest.raises(openai.BadRequestError) as missing:
        await oai.responses.create(model="embedded", input="y", previous_response_id=unstored.id)
    assert missing.value.body["code"] == "previous_response_not_found"
    assert missing.value.body["param"] == "previous_response_id"


async def test_a_chain_survives_eviction_of_its_ancestors(tokenizer):
    engine, _, oai, _ = make(tokenizer, max_stored_responses=1)
    engine.scripts = [Script(["one"]), Script(["two"]), Script(["three"])]
    first = await oai.responses.create(model="embedded", input="a")
    second = await oai.responses.create(model="embedded", input="b", previous_response_id=first.id)
    await oai.responses.create(model="embedded", input="c", previous_response_id=second.id)
    text = tokenizer.decode(engine.requests[2].prompt, skip_special_tokens=False)
    assert all(word in text for word in ("one", "two")) and text.index("one") < text.index("two")


async def test_parallel_tool_calls_false_and_tool_choice(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    two = ["x", CALL_TEXT, CALL_TEXT.replace("Paris", "Rome")]
    engine.scripts = [Script(two), Script([CALL_TEXT.replace("Paris", "Oslo")])]
    one = await oai.responses.create(model="embedded", input="q", tools=[TOOL], parallel_tool_calls=False)
    assert [i.arguments for i in one.output if i.type == "function_call"] == ['{"city": "Paris"}']
    named = await oai.responses.create(model="embedded", input="q", tools=[TOOL],
                                       tool_choice={"type": "function", "name": "get_weather"})
    assert tokenizer.decode(engine.requests[1].prompt).endswith("assistant\n")  # a grammar forces the call
    assert "get_weather" in engine.requests[1].params.structured_outputs.structural_tag
    assert named.output[-1].arguments == '{"city": "Oslo"}' and named.tool_choice.name == "get_weather"


async def test_cut_off_response_is_incomplete(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    engine.scripts = [Script(["partial answer"], finish_reason="length"), Script(["partial"], finish_reason="length")]
    out = await oai.responses.create(model="embedded", input="q", max_output_tokens=3)
    assert (out.status, out.incomplete_details.reason, out.output[0].status) == ("incomplete", "max_output_tokens",
                                                                                 "incomplete")
    kinds = [e.type async for e in await oai.responses.create(model="embedded", input="q", max_output_tokens=3,
                                                             stream=True)]
    assert kinds[-1] == "response.incomplete"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "function tools"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs a schema"),
        ({"background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text-only"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"input": []}, "empty"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": "\ud800"}, "surrogate"),
    ],
)
async def test_bad_requests_are_400_with_openai_bodies(tokenizer, fields, words):
    _, http, _, _ = make(tokenizer)
    response = await http.post("/v1/responses", content=json.dumps({"input": "x", **fields}).encode(),
                               headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error
