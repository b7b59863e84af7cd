"""`tokenspeed serve` end to end: one real server subprocess (embedded model), official clients.

Covers the issue's acceptance list that needs a real engine: completions,
chat (streamed == non-streamed == offline `LLM.chat`), byte-stable 5-turn
tool history with growing prefix-cache hits, Anthropic messages and
count_tokens, a parsed Prometheus scrape, 100 concurrent streams with exact
usage, 20 disconnecting clients leaving no referenced KV page, error
statuses, and a clean SIGTERM shutdown (last test: it stops the server).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenspeed.api.parsers import OutputParser

KEY = "test-key"
PAGE_SIZE = 16
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def start_server(log: Path, *extra: str) -> SimpleNamespace:
    """Start `tokenspeed serve` on a free loopback port and wait until /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "tokenspeed.cli", "serve", "--port", str(port), "--max-model-len", "1024",
               "--uvicorn-log-level", "warning", *extra]
    handle = log.open("w")
    # One intra-op thread: the tiny model's ops are too small to split, and on a shared CPU
    # oversubscribed OpenMP threads make every step ~10x slower.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx2.get(url + "/health", timeout=1).status_code == 200:
                return SimpleNamespace(url=url, proc=proc, log=log)
        except httpx2.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def stop_server(server: SimpleNamespace) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    running = start_server(log, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--api-key", KEY)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def http(server):
    """One keep-alive client: a fresh httpx client per call costs ~0.1 s of TLS setup."""
    with httpx2.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


def kv(http) -> dict:
    return http.get("/debug/kv").json()


def tokenize(http, messages, **extra) -> list[int]:
    return http.post("/tokenize", json={"messages": messages, **extra}).json()["tokens"]


def chat_kwargs(content: str, **extra):
    return {"model": "embedded", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def test_completions(oai):
    out = oai.completions.create(model="embedded", prompt="def fib(n):", max_tokens=8, temperature=0,
                                 logprobs=2, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.usage.completion_tokens == 8 and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 8 and all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text


def test_chat_stream_equals_non_stream_equals_offline_llm(oai):
    import torch

    from tokenspeed import LLM, SamplingParams

    kwargs = chat_kwargs("Write a haiku about caches.", max_tokens=24)
    whole = oai.chat.completions.create(**kwargs).choices[0].message
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == whole.content
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs (see start_server)
    try:
        llm = LLM(max_model_len=1024, show_progress=False)
        offline = llm.chat(kwargs["messages"], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    finally:
        torch.set_num_threads(threads)
    expected = OutputParser(reasoning_parser="qwen3").parse(offline)  # the server runs --reasoning-parser qwen3
    assert (whole.reasoning_content, whole.content or None) == (expected.reasoning, expected.content)


def test_five_tool_turns_render_byte_stably_and_hit_the_cache(http, oai):
    messages = [{"role": "system", "content": "You are a weather agent."},
                {"role": "user", "content": "Compare the weather in five cities."}]
    previous: list[int] = []
    cached = []
    for turn in range(5):
        rendered = tokenize(http, messages, tools=[WEATHER])
        assert rendered[: len(previous)] == previous, f"turn {turn} changed the rendering of earlier turns"
        out = oai.chat.completions.create(model="embedded", messages=messages, tools=[WEATHER], temperature=0,
                                          max_tokens=4)
        assert out.usage.prompt_tokens == len(rendered)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        if turn:
            assert cached[-1] >= len(previous) // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE
        call_id = f"call_{turn}"
        # the client re-serialises arguments its own way; the server must render them canonically
        messages.append({"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city" :"City ' + str(turn) + '"}'}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"{10 + turn} degrees"})
        previous = rendered
    assert cached == sorted(cached) and cached[-1] > cached[1] > 0
    text = http.post("/detokenize", json={"tokens": previous}).json()
    assert '{"name": "get_weather", "arguments": {"city": "City 3"}}' in text["prompt"]


def test_anthropic_messages_stream_and_count_tokens(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    kwargs = {"model": "embedded", "max_tokens": 12, "system": "Be terse.", "extra_body": {"temperature": 0},
              "messages": [{"role": "user", "content": "Name three colours."}]}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    text = "".join(b.text for b in whole.content if b.type == "text")
    assert streamed == text and final.usage.output_tokens == whole.usage.output_tokens
    counted = client.messages.count_tokens(model="embedded", system="Be terse.", messages=kwargs["messages"])
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens > 0  # the second identical prompt reused the first's pages


def test_prometheus_scrape_parses(http, oai):
    oai.chat.completions.create(**chat_kwargs("metrics please", max_tokens=4))
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    value = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    for name in ("tokenspeed_num_requests_running", "tokenspeed_num_requests_waiting", "tokenspeed_kv_cache_usage_ratio"):
        assert families[name].type == "gauge"
    assert value["tokenspeed_prompt_tokens_total"] > 0 and value["tokenspeed_generation_tokens_total"] > 0
    assert families["tokenspeed_cached_prompt_tokens"].type == "counter"
    for name in ("tokenspeed_time_to_first_token_seconds", "tokenspeed_inter_token_latency_seconds",
                 "tokenspeed_e2e_request_latency_seconds", "tokenspeed_request_queue_time_seconds"):
        assert families[name].type == "histogram" and value[name + "_count"] > 0
    # The queue time is the part of TTFT spent before the scheduler admitted the request.
    queue, ttft = "tokenspeed_request_queue_time_seconds", "tokenspeed_time_to_first_token_seconds"
    assert value[queue + "_count"] <= value[ttft + "_count"] and value[queue + "_sum"] <= value[ttft + "_sum"]


def test_100_concurrent_streams_complete_with_exact_usage(server, http):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        stream = await client.chat.completions.create(
            **chat_kwargs(f"request number {i}", max_tokens=6), stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, finish = None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        return usage.prompt_tokens, usage.completion_tokens, finish

    async def run() -> list[tuple[int, int, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    results = asyncio.run(run())
    for i, (prompt_tokens, completion_tokens, finish) in enumerate(results):
        expected = len(tokenize(http, chat_kwargs(f"request number {i}")["messages"]))
        assert (prompt_tokens, completion_tokens, finish) == (expected, 6, "length")


def test_disconnected_streams_release_their_pages(server, http):
    before = kv(http)

    async def leave_early(client: httpx2.AsyncClient, i: int) -> None:
        body = chat_kwargs(f"long story {i}", max_tokens=1000, stream=True, ignore_eos=True)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            received = 0
            async for line in response.aiter_lines():
                received += line.startswith("data:")
                if received >= 3:
                    break  # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx2.AsyncClient(base_url=server.url, headers={"x-api-key": KEY}, timeout=60) as client:
            await asyncio.gather(*(leave_early(client, i) for i in range(20)))

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while (stats := kv(http))["kv_pages_referenced"] or stats["num_running"] or stats["num_waiting"]:
        assert time.monotonic() < deadline, f"pages still referenced after disconnects: {stats}"
        time.sleep(0.1)
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert stats["generation_tokens_total"] - before["generation_tokens_total"] < 20 * 200  # aborted, not run out


def test_error_statuses(server, http, oai):
    bare = http.post("/v1/chat/completions", json=chat_kwargs("x"), headers={"x-api-key": ""})
    assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(**{**chat_kwargs("x"), "model": "gpt-4o"})
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        oai.completions.create(model="embedded", prompt=[7] * 1500, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="n"):
        oai.chat.completions.create(**chat_kwargs("x", n=0))
    anth = http.post("/v1/messages", json={"model": "embedded", "messages": [{"role": "user", "content": "x"}]})
    assert anth.status_code == 400 and anth.json()["type"] == "error"


def test_sigterm_shuts_down_cleanly(server, http):
    engine_pid = kv(http)["engine_pid"]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.log.read_text()[-3000:]
    deadline = time.monotonic() + 5
    while Path(f"/proc/{engine_pid}").exists() and "zombie" not in _state(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"
