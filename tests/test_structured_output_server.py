"""Structured output, forced tool calls and logit bias against a live `tokenspeed serve` (embedded model,
random or trained weights alike), through the official `openai` and `anthropic` clients.

The acceptance bar of issue 17: 100 requests with a non-trivial JSON schema (nested objects, enums,
arrays, required fields) all return schema-valid JSON, and `tool_choice="required"` always yields a
parseable call, whatever the weights. Every test ends with no KV page referenced (`/debug/kv`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import anthropic
import httpx2
import jsonschema
import openai
import pytest

from tests.test_api_server import start_server, stop_server
from tests.test_structured_output_engine import SCHEMA
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.models.embedded.materialize import package_dir

MODEL = "embedded"
LS = {"type": "function", "function": {"name": "ls", "description": "List a folder", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 8},
                                     "depth": {"type": "integer", "minimum": 0, "maximum": 3}},
    "required": ["path"]}}}
GREP = {"type": "function", "function": {"name": "grep", "description": "Search files", "parameters": {
    "type": "object", "properties": {"pattern": {"type": "string", "maxLength": 6},
                                     "files": {"type": "array", "items": {"enum": ["a.py", "b.py"]}, "maxItems": 2},
                                     "mode": {"enum": ["fixed", "regex"]}},
    "required": ["pattern", "mode"]}}}
TOOLS = [LS, GREP]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "Find the config files."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    running = start_server(log, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def no_page_left_referenced(server):
    yield
    deadline = time.monotonic() + 10
    while (stats := httpx2.get(server.url + "/debug/kv").json())["kv_pages_referenced"] or stats["num_running"]:
        assert time.monotonic() < deadline, f"pages still referenced: {stats}"
        time.sleep(0.05)


def _check_call(name: str, arguments: str | dict) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])


def _whole(calls: list, cut: bool) -> list:
    """The calls that must be whole: all of them, or all but the last when max_tokens cut the output (the
    grammar lets a model make as many parallel calls as it likes, and this one may not stop)."""
    assert calls
    return calls[:-1] if cut else calls


def test_100_json_schema_requests_all_validate(server):
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as aclient:
            fmt = {"type": "json_schema", "json_schema": {"name": "entry", "schema": SCHEMA, "strict": True}}
            replies = await asyncio.gather(*(
                aclient.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Describe entry {i}."}], max_tokens=120,
                    temperature=1.0, seed=i, response_format=fmt)
                for i in range(100)))
        assert all(r.choices[0].finish_reason == "stop" for r in replies)
        return [r.choices[0].message.content or "" for r in replies]

    texts = asyncio.run(run())
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 50  # sampled: these are not one answer repeated


def test_tool_choice_required_always_yields_parseable_calls(client):
    for seed in range(8):
        reply = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                               max_tokens=100, temperature=1.0, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason in ("tool_calls", "length"), choice
        for call in _whole(choice.message.tool_calls, choice.finish_reason == "length"):
            _check_call(call.function.name, call.function.arguments)
        if choice.finish_reason == "tool_calls":
            assert not choice.message.content


def test_named_function_single_call_and_streaming(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=200, temperature=1.0, seed=5,
        tool_choice={"type": "function", "function": {"name": "grep"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "grep"
    _check_call("grep", call.function.arguments)
    for seed in range(3):
        single = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
        assert single.choices[0].finish_reason == "tool_calls"
        (call,) = single.choices[0].message.tool_calls
        _check_call(call.function.name, call.function.arguments)
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, temperature=1.0, seed=7, stream=True)
    calls: dict[int, list[str]] = {}
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
    assert calls
    for name, arguments in calls.values():
        _check_call(name, arguments)


def test_vllm_extra_fields_and_json_object(client):
    completion = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, temperature=1.0, seed=1,
                                           extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert completion.choices[0].text in ("yes", "no", "maybe")
    regex = client.completions.create(model=MODEL, prompt="Date:", max_tokens=20, temperature=1.0, seed=2,
                                      extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", regex.choices[0].text)
    grammar = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20, temperature=1.0, seed=3,
                                             extra_body={"guided_grammar": 'root ::= "ls " [a-z] [a-z]?'})
    assert re.fullmatch("ls [a-z][a-z]?", grammar.choices[0].message.content)
    newer = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20, temperature=0.0,
                                           extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert newer.choices[0].message.content in ("left", "right")
    guided = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=120, temperature=1.0, seed=4,
                                            extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(guided.choices[0].message.content), SCHEMA)
    brace = load_tokenizer(package_dir()).convert_tokens_to_ids("}")  # pushed up: the object closes at once
    obj = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, temperature=1.0, seed=5,
                                         response_format={"type": "json_object"}, logit_bias={str(brace): 100})
    assert json.loads(obj.choices[0].message.content) == {}


def test_logit_bias_forces_and_forbids(client):
    tokenizer = load_tokenizer(package_dir())
    forced = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, temperature=1.0, seed=1,
                                       logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tokenizer.decode([77] * 5)
    free = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=1, temperature=0.0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    first = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(free.choices[0].logprobs.tokens[0]))[0]
    banned = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=1, temperature=0.0, logprobs=0,
                                       logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert banned.choices[0].logprobs.tokens[0] != free.choices[0].logprobs.tokens[0]


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "properties": 7}}}},
     "JSON schema cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs a schema"),
    ({"response_format": {"type": "yaml"}}, "not supported"),
    ({"guided_regex": "(", "guided_choice": ["a"]}, "not guided_regex and guided_choice"),
    ({"guided_regex": "("}, "regex cannot be compiled"),
    ({"guided_grammar": "root ::= "}, "EBNF grammar cannot be compiled"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias token ids"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300"),
])
def test_bad_constraints_are_400(client, extra, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, extra_body=extra)


def test_anthropic_tool_input_schemas(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice in [{"type": "any"}, {"type": "tool", "name": "ls"}, {"type": "any", "disable_parallel_tool_use": True}]:
        message = claude.messages.create(model=MODEL, max_tokens=300, messages=USER, tools=tools, tool_choice=choice)
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason in ("tool_use", "max_tokens")
        for use in _whole(uses, message.stop_reason == "max_tokens"):
            _check_call(use.name, use.input)
        if choice["type"] == "tool":
            assert [use.name for use in uses] == ["ls"]


def test_responses_text_format_and_required_tools(client):
    response = client.responses.create(model=MODEL, input="Describe one entry.", max_output_tokens=120, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "entry", "schema": SCHEMA,
                                                        "strict": True}})
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    called = client.responses.create(model=MODEL, input="Find the config files.", tools=tools, temperature=0,
                                     tool_choice="required", max_output_tokens=200)
    calls = [item for item in called.output if item.type == "function_call"]
    for call in _whole(calls, called.status == "incomplete"):
        _check_call(call.name, call.arguments)
