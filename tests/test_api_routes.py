"""Route behaviour against a scripted engine, through the official OpenAI and Anthropic clients.

The embedded model's output is random, so what only a specific output can
exercise (tool calls, reasoning, stop sequences) is tested here with an
engine that plays a script; the real-server tests cover the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import anthropic
import httpx2
import openai
import pytest

from tokenspeed.api.app import build_app
from tokenspeed.api.settings import ServerSettings
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.engine.outputs import Logprob
from tokenspeed.engine.stream import EngineStats, RequestDelta, StreamDelta
from tokenspeed.errors import ContextTooLong, EngineDead, EngineOverloaded
from tokenspeed.models.embedded.materialize import embedded_model_path

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def anyio_backend():
    return "asyncio"


@dataclass
class Script:
    chunks: list[str]
    finish_reason: str = "stop"
    stop_reason: int | str | None = None


@dataclass
class ScriptedEngine:
    """Implements the AsyncEngine interface the API uses; plays scripted outputs in order."""

    tokenizer: object
    max_model_len: int = 1024
    vocab_size: int = 4096
    on_dead: object = None
    healthy: bool = True
    error: Exception | None = None
    scripts: list[Script] = field(default_factory=list)
    requests: list[SimpleNamespace] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def generate(self, request_id, prompt_token_ids, params):
        if self.error is not None:
            raise self.error
        script = self.scripts.pop(0) if self.scripts else Script(["ok"])
        self.requests.append(SimpleNamespace(id=request_id, prompt=list(prompt_token_ids), params=params))
        return self._play(request_id, list(prompt_token_ids), params, script)

    async def _play(self, request_id, prompt, params, script):
        for position, chunk in enumerate(script.chunks):
            last = position == len(script.chunks) - 1
            ids = self.tokenizer.encode(chunk, add_special_tokens=False)
            logprobs = None
            if params.logprobs is not None:
                logprobs = [{t: Logprob(-0.25, 1, self.tokenizer.decode([t]))} for t in ids]
            deltas = [StreamDelta(i, chunk, list(ids), logprobs, script.finish_reason if last else None,
                                  script.stop_reason if last else None) for i in range(params.n)]
            prompt_logprobs = None
            if position == 0 and params.prompt_logprobs is not None:  # token i scores -i/100, ranked first
                prompt_logprobs = [None] + [{t: Logprob(-i / 100, 1, self.tokenizer.decode([t]))}
                                            for i, t in enumerate(prompt[1:], start=1)]
            yield RequestDelta(request_id, deltas, prompt, 4, prompt_logprobs, last)
            await asyncio.sleep(0)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def is_healthy(self):
        return self.healthy

    def stats(self):
        return EngineStats(kv_pages_total=8, kv_pages_free=8)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


def make(tokenizer, **settings):
    engine = ScriptedEngine(tokenizer)
    options = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3", **settings}
    app = build_app(engine, ServerSettings(**options))
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test")
    oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", http_client=http, max_retries=0)
    ant = anthropic.AsyncAnthropic(base_url="http://test", api_key="k", http_client=http, max_retries=0)
    return engine, http, oai, ant


def user(text):
    return [{"role": "user", "content": text}]


async def test_tool_call_round_trip_keeps_prompt_a_prefix(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    engine.scripts = [Script(["Checking.\n", CALL_TEXT[:15], CALL_TEXT[15:]]), Script(["It is sunny."])]
    messages = user("Weather in Paris?")
    first = await oai.chat.completions.create(model="embedded", messages=messages, tools=[WEATHER])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris"}'
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = await oai.chat.completions.create(model="embedded", messages=messages, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny." and second.choices[0].finish_reason == "stop"
    before, after = engine.requests[0].prompt, engine.requests[1].prompt
    assert after[: len(before)] == before
    rendered = tokenizer.decode(after[len(before):], skip_special_tokens=False)
    assert rendered.startswith("Checking.\n" + CALL_TEXT + "<|im_end|>")  # exactly what the model wrote
    assert first.usage.prompt_tokens_details.cached_tokens == 4


async def test_streamed_tool_calls_and_reasoning_equal_non_streamed(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    chunks = ["<th", "ink>\nplan", "\n</think>\n\n", "Calling", " now", CALL_TEXT[:5], CALL_TEXT[5:], "\n"]
    engine.scripts = [Script(chunks), Script(chunks)]
    whole = (await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER])).choices[0]
    stream = await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER], stream=True)
    content, reasoning, calls, finish = "", "", {}, None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:  # accumulated by index, as OpenAI clients do
            name, arguments = calls.get(call.index, (call.function.name, ""))
            calls[call.index] = (name, arguments + call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert whole.message.reasoning_content == reasoning == "plan"
    assert whole.message.content == content == "Calling now"
    assert list(calls.values()) == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason == "tool_calls"


async def test_named_tool_choice_is_enforced_by_a_grammar(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    named = {"type": "function", "function": {"name": "get_weather"}}
    engine.scripts = [Script(['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'])]
    ok = await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER], tool_choice=named)
    prompt = tokenizer.decode(engine.requests[0].prompt, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n")  # the same prompt whatever tool_choice says
    grammar = json.loads(engine.requests[0].params.structured_outputs.structural_tag)
    assert "get_weather" in json.dumps(grammar) and grammar["type"] == "structural_tag"
    assert ok.choices[0].message.tool_calls[0].function.arguments == '{"city": "Oslo"}'


async def test_named_tool_choice_without_a_grammar_is_forced_through_the_prompt_and_checked(tokenizer):
    engine, _, oai, _ = make(tokenizer, tool_call_parser="glm45", reasoning_parser=None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    engine.scripts = [Script(["<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"]),
                      Script(["no call at all"])]
    ok = await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER], tool_choice=named)
    prompt = tokenizer.decode(engine.requests[0].prompt, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<tool_call>get_weather\n")
    assert engine.requests[0].params.structured_outputs is None
    assert ok.choices[0].message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    with pytest.raises(openai.InternalServerError) as failure:
        await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER], tool_choice=named)
    assert failure.value.body["code"] == "invalid_model_output"


async def test_tool_choice_errors_are_400(tokenizer):
    _, _, oai, _ = make(tokenizer)
    with pytest.raises(openai.BadRequestError, match="no tools"):
        await oai.chat.completions.create(model="embedded", messages=user("q"), tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        await oai.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER],
                                          tool_choice={"type": "function", "function": {"name": "nope"}})
    _, _, plain, _ = make(tokenizer, tool_call_parser=None)
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        await plain.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER])
    none = await plain.chat.completions.create(model="embedded", messages=user("q"), tools=[WEATHER],
                                               tool_choice="none")
    assert none.choices[0].message.content == "ok"


async def test_n_logprobs_and_stop_reason(tokenizer):
    engine, _, oai, _ = make(tokenizer, reasoning_parser=None)
    engine.scripts = [Script(["a b", " c"], stop_reason="END")]
    out = await oai.chat.completions.create(model="embedded", messages=user("q"), n=2, logprobs=True, top_logprobs=1,
                                            stop=["END"], seed=7, max_completion_tokens=9, temperature=0.5)
    params = engine.requests[0].params
    assert (params.n, params.stop, params.seed, params.max_tokens, params.logprobs) == (2, ["END"], 7, 9, 1)
    assert [c.index for c in out.choices] == [0, 1]
    tokens = [t.token for t in out.choices[1].logprobs.content]
    assert "".join(tokens) == out.choices[1].message.content == "a b c"
    assert out.usage.completion_tokens == 2 * len(tokenizer.encode("a b")) + 2 * len(tokenizer.encode(" c"))


async def test_completions_with_several_prompts_stream_and_echo(tokenizer):
    engine, http, oai, _ = make(tokenizer)
    engine.scripts = [Script(["x", "y"]), Script(["z"])]
    out = await oai.completions.create(model="embedded", prompt=["p1", "p2"], echo=True, max_tokens=4)
    assert [(c.index, c.text) for c in out.choices] == [(0, "p1xy"), (1, "p2z")]
    engine.scripts = [Script(["x", "y"]), Script(["z"])]
    text: dict[int, str] = {}
    async for chunk in await oai.completions.create(model="embedded", prompt=[[5, 6], [7]], stream=True,
                                                    stream_options={"include_usage": True}):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
        usage = chunk.usage
    assert text == {0: "xy", 1: "z"} and usage.prompt_tokens == 3


async def test_anthropic_blocks_streaming_and_stop_sequence(tokenizer):
    engine, _, _, ant = make(tokenizer)
    script = ["<think>\nhmm\n</think>\n\n", "Let me look.", CALL_TEXT]
    engine.scripts = [Script(script), Script(script), Script(["done", " END"], stop_reason="END")]
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}]
    kwargs = {"model": "embedded", "max_tokens": 50, "tools": tools, "system": "Be brief.",
              "messages": [{"role": "user", "content": "Weather?"}]}
    whole = await ant.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.content[0].thinking == "hmm" and whole.content[2].input == {"city": "Paris"}
    assert whole.stop_reason == "tool_use"
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens) == (len(engine.requests[0].prompt) - 4, 4)
    async with ant.messages.stream(**kwargs) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use"]
    assert [b.model_dump(exclude={"id", "signature"}) for b in streamed.content] == [
        b.model_dump(exclude={"id", "signature"}) for b in whole.content]
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": whole.content[2].id,
                                             "content": "sunny"}]}]
    last = await ant.messages.create(**{**kwargs, "messages": history, "stop_sequences": ["END"]})
    assert (last.stop_reason, last.stop_sequence, last.content[0].text) == ("stop_sequence", "END", "done END")
    first, third = engine.requests[0].prompt, engine.requests[2].prompt
    assert third[: len(first)] == first  # the Anthropic history re-renders byte-stably too


async def test_anthropic_count_tokens_matches_the_prompt(tokenizer):
    engine, _, _, ant = make(tokenizer)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    counted = await ant.messages.count_tokens(model="embedded", messages=messages, system="sys")
    await ant.messages.create(model="embedded", max_tokens=5, messages=messages, system="sys")
    assert counted.input_tokens == len(engine.requests[0].prompt)


@pytest.mark.parametrize(
    ("error", "status"),
    [(ContextTooLong("max_model_len is 1024"), 400), (EngineOverloaded("queue full"), 429),
     (EngineDead("gone"), 503)],
)
async def test_engine_errors_map_to_statuses_in_both_dialects(tokenizer, error, status):
    engine, http, _, _ = make(tokenizer)
    engine.error = error
    oai = await http.post("/v1/chat/completions", json={"model": "embedded", "messages": user("q")})
    assert oai.status_code == status and str(error) in oai.json()["error"]["message"]
    ant = await http.post("/v1/messages", json={"model": "embedded", "max_tokens": 5, "messages": user("q")})
    assert ant.status_code == status and ant.json()["type"] == "error" and str(error) in ant.json()["error"]["message"]


async def test_request_validation_and_model_errors(tokenizer):
    _, http, oai, ant = make(tokenizer)
    missing = await http.post("/v1/chat/completions", json={"model": "embedded"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    bad_value = await http.post("/v1/completions", json={"prompt": "x", "temperature": -1})
    assert bad_value.status_code == 400 and "temperature" in bad_value.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="response_format"):
        await oai.chat.completions.create(model="embedded", messages=user("q"), response_format={"type": "yaml"})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await oai.chat.completions.create(model="gpt-9", messages=user("q"))
    with pytest.raises(anthropic.NotFoundError):
        await ant.messages.create(model="claude-x", max_tokens=5, messages=user("q"))
    no_max = await http.post("/v1/messages", json={"model": "embedded", "messages": user("q")})
    assert no_max.status_code == 400 and no_max.json()["error"]["type"] == "invalid_request_error"
    image = await http.post("/v1/chat/completions", json={"model": "embedded", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert image.status_code == 400 and "text-only" in image.json()["error"]["message"]
    assert (await http.get("/nope")).status_code == 404


async def test_api_key_is_required_where_it_should_be(tokenizer):
    engine, http, _, _ = make(tokenizer, api_key="s3cret")
    body = {"model": "embedded", "messages": user("q")}
    assert (await http.post("/v1/chat/completions", json=body)).status_code == 401
    wrong = await http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    ok = await http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    anth = await http.post("/v1/messages", json={**body, "max_tokens": 3}, headers={"x-api-key": "s3cret"})
    assert anth.status_code == 200
    assert (await http.get("/debug/kv")).status_code == 401
    assert (await http.get("/health")).status_code == 200 and (await http.get("/metrics")).status_code == 200
    engine.healthy = False
    assert (await http.get("/health")).status_code == 503


async def test_stats_and_tokenize_routes(tokenizer):
    engine, http, _, _ = make(tokenizer)
    kv = (await http.get("/debug/kv")).json()
    assert dataclasses.asdict(engine.stats()).items() <= kv.items()
    tokens = (await http.post("/tokenize", json={"prompt": "hello world"})).json()
    assert tokens["tokens"] == tokenizer.encode("hello world") and tokens["max_model_len"] == 1024
    text = (await http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
    assert text == {"prompt": "hello world"}
    chat = (await http.post("/tokenize", json={"messages": user("hi")})).json()
    assert tokenizer.decode(chat["tokens"], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert (await http.post("/detokenize", json={"tokens": [99999]})).status_code == 400
