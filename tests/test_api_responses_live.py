"""The Responses API and prompt logprobs on a real `tokenspeed serve` (embedded model), official client.

A response is a chat turn in another shape, so with greedy sampling it must
answer exactly what chat answers for the same messages; streamed events
must concatenate to the non-streamed response; `previous_response_id`
turns must hit the prefix cache more and more; prompt logprobs over HTTP
must be the offline engine's.
"""

from __future__ import annotations

import openai
import pytest

from tests.test_api_server import start_server, stop_server

KEY = "responses-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "server.log"
    running = start_server(log, "--api-key", KEY, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                           "--max-stored-responses", "4")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


def test_response_equals_chat_and_streams_the_same(oai):
    kwargs = {"model": "embedded", "instructions": "Answer in Python.", "input": "Sum a list.",
              "max_output_tokens": 12, "temperature": 0}
    response = oai.responses.create(**kwargs)
    chat = oai.chat.completions.create(model="embedded", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "Sum a list."}])
    reasoning = "".join(p.text for i in response.output if i.type == "reasoning" for p in i.content)
    assert (reasoning or None, response.output_text or None) == (chat.choices[0].message.reasoning_content,
                                                                 chat.choices[0].message.content or None)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")

    text, kinds = "", []
    for event in oai.responses.create(**kwargs, stream=True):
        kinds.append(event.type)
        text += event.delta if event.type == "response.output_text.delta" else ""
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert text == response.output_text
    with oai.responses.stream(**{k: v for k, v in kwargs.items()}) as stream:
        for _ in stream:
            pass
        if response.status == "completed":
            assert stream.get_final_response().output_text == response.output_text


def test_previous_response_id_turns_hit_the_cache_more_and_more(oai):
    previous, cached = None, []
    for turn in range(4):
        response = oai.responses.create(model="embedded", input=f"Step {turn}: continue the program.",
                                        instructions="You write Python.", max_output_tokens=24, temperature=0,
                                        previous_response_id=previous)
        cached.append(response.usage.input_tokens_details.cached_tokens)
        previous = response.id
    assert cached[1] > 0 and cached == sorted(cached) and cached[-1] > cached[1]
    assert oai.responses.retrieve(previous).id == previous
    oai.responses.delete(previous)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(previous)


def test_prompt_logprobs_over_http_are_the_engines(server, oai):
    import httpx2
    import torch

    from tokenspeed import LLM, SamplingParams

    with httpx2.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=60) as http:
        prompt = http.post("/tokenize", json={"prompt": "def fibonacci(n):\n    if n < 2:"}).json()["tokens"]
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 2}
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs
    try:
        offline = LLM(max_model_len=1024, show_progress=False).generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    finally:
        torch.set_num_threads(threads)
    served, echoed = choice["prompt_logprobs"], choice["logprobs"]
    assert served[0] is None and echoed["token_logprobs"][0] is None and len(served) == len(prompt)
    for position in range(1, len(prompt)):
        token = prompt[position]
        expected = offline.prompt_logprobs[position]
        assert served[position][str(token)]["logprob"] == pytest.approx(expected[token].logprob, abs=1e-4)
        assert echoed["token_logprobs"][position] == pytest.approx(expected[token].logprob, abs=1e-4)
        top = {str(t) for t, lp in expected.items() if lp.rank is not None and lp.rank <= 2} | {str(token)}
        assert set(served[position]) == top
    assert len(echoed["tokens"]) == len(prompt) + 1 and "".join(echoed["tokens"]) == choice["text"]
