"""Prompt logprobs, `echo` with logprobs, and per-chunk usage over HTTP (scripted engine).

The scripted engine scores prompt token i with logprob -i/100 and every
output token with -0.25, so each number in a response can be traced to
the position it belongs to.
"""

from __future__ import annotations

import pytest

from tests.test_api_routes import Script, make, user
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.models.embedded.materialize import embedded_model_path

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


async def test_echo_with_logprobs_puts_the_prompt_tokens_first(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    engine.scripts = [Script([" world", "!"]), Script([" world", "!"])]
    prompt = "hello there"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = (await oai.completions.create(model="embedded", prompt=prompt, echo=True, logprobs=1, max_tokens=4)).choices[0]
    assert engine.requests[0].params.prompt_logprobs == 1
    logprobs = out.logprobs
    assert out.text == prompt + " world!" and "".join(logprobs.tokens) == out.text
    assert logprobs.token_logprobs[: len(ids)] == [None] + [-i / 100 for i in range(1, len(ids))]
    assert logprobs.top_logprobs[0] is None and all(v == -0.25 for v in logprobs.token_logprobs[len(ids):])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[len(ids)] == len(prompt)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    streamed_tokens, streamed_text = [], ""
    async for chunk in await oai.completions.create(model="embedded", prompt=prompt, echo=True, logprobs=1,
                                                    max_tokens=4, stream=True):
        streamed_text += chunk.choices[0].text
        streamed_tokens += chunk.choices[0].logprobs.tokens
    assert (streamed_text, streamed_tokens) == (out.text, logprobs.tokens)


async def test_prompt_logprobs_as_vllm_returns_them(tokenizer):
    engine, http, _, _ = make(tokenizer, reasoning_parser=None)
    completion = (await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2,
                                                           "prompt_logprobs": 0})).json()
    decoded = tokenizer.decode([6])
    assert completion["choices"][0]["prompt_logprobs"] == [
        None, {"6": {"logprob": -0.01, "rank": 1, "decoded_token": decoded}},
        {"7": {"logprob": -0.02, "rank": 1, "decoded_token": tokenizer.decode([7])}}]
    chat = (await http.post("/v1/chat/completions", json={"messages": user("hi"), "prompt_logprobs": 2})).json()
    prompt = engine.requests[1].prompt
    assert engine.requests[1].params.prompt_logprobs == 2
    assert len(chat["prompt_logprobs"]) == len(prompt) and chat["prompt_logprobs"][0] is None
    assert all(list(entry) == [str(token)] for entry, token in zip(chat["prompt_logprobs"][1:], prompt[1:]))
    plain = (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).json()
    assert "prompt_logprobs" not in plain["choices"][0]


@pytest.mark.parametrize(
    ("path", "fields", "words"),
    [
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": "2"}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "stream"),
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "stream"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
    ],
)
async def test_bad_logprob_and_stream_fields_are_400(tokenizer, path, fields, words):
    _, http, _, _ = make(tokenizer)
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": user("x")}
    response = await http.post(path, json={**body, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]


def _tokens(text: str, tok) -> int:
    return len(tok.encode(text, add_special_tokens=False))


async def test_continuous_usage_counts_every_chunk(tokenizer):
    """Each chunk's usage is the request's tokens so far (both samples), the last usage chunk the total."""
    engine, _, oai, _ = make(tokenizer, reasoning_parser=None)
    pieces = ["alpha", " beta gamma", " delta"]
    engine.scripts = [Script(pieces)]
    seen, per_chunk, prompt_tokens = 0, [], set()
    async for chunk in await oai.chat.completions.create(
            model="embedded", messages=user("q"), n=2, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}):
        for choice in chunk.choices:
            seen += _tokens(choice.delta.content or "", tokenizer)
        per_chunk.append(chunk.usage.completion_tokens)
        prompt_tokens.add(chunk.usage.prompt_tokens)
        assert chunk.usage.completion_tokens == seen
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    assert per_chunk[-1] == 2 * sum(_tokens(p, tokenizer) for p in pieces) and per_chunk == sorted(per_chunk)
    assert prompt_tokens == {len(engine.requests[0].prompt)}
    assert chunk.choices == [] and chunk.usage.prompt_tokens_details.cached_tokens == 4  # the usage chunk


async def test_continuous_usage_needs_include_usage_and_covers_completions(tokenizer):
    engine, _, oai, _ = make(tokenizer)
    engine.scripts = [Script(["a b"])]
    chunks = [c async for c in await oai.chat.completions.create(
        model="embedded", messages=user("q"), stream=True, stream_options={"continuous_usage_stats": True})]
    assert all(c.usage is None for c in chunks)  # as vLLM: continuous stats only with include_usage
    engine.scripts = [Script(["x", "y"]), Script(["z"])]
    usages = [c.usage async for c in await oai.completions.create(
        model="embedded", prompt=["p1", "p2"], stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert all(u is not None for u in usages) and usages[-1].completion_tokens == 3
    assert [u.completion_tokens for u in usages] == sorted(u.completion_tokens for u in usages)
