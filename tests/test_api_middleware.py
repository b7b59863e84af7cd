"""The app's error plumbing: a 500 keeps the connection, 413 before parsing, Retry-After on overload.

A real 500 cannot be provoked through the live server any more (every
reproducer is a 4xx now), so a scripted engine raises an unexpected error
here, under a real uvicorn, where the keep-alive connection can be watched.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

import pytest
import uvicorn

from tests.test_api_routes import ScriptedEngine, make
from tokenspeed.api.app import build_app
from tokenspeed.api.args import add_serve_args, serve_config
from tokenspeed.api.settings import ServerSettings
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.errors import EngineDead, EngineOverloaded
from tokenspeed.models.embedded.materialize import embedded_model_path

pytestmark = pytest.mark.anyio
USER = [{"role": "user", "content": "q"}]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


class _ExplodingEngine(ScriptedEngine):
    def generate(self, request_id, prompt_token_ids, params):
        raise RuntimeError("a bug in the engine")


def _read_response(reader) -> tuple[int, dict[str, str], bytes]:
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, reader.read(int(headers.get("content-length", "0")))


def test_a_500_keeps_the_keep_alive_connection(tokenizer):
    app = build_app(_ExplodingEngine(tokenizer), ServerSettings())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            reader = sock.makefile("rb")
            body = b'{"prompt": "x", "max_tokens": 2}'
            request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
            for _ in range(3):
                sock.sendall(request)
                status, headers, payload = _read_response(reader)
                assert status == 500 and b"a bug in the engine" in payload
                assert headers.get("connection") != "close"
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")  # same connection, still served
                assert _read_response(reader)[0] == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)


async def test_body_over_the_limit_is_413_in_both_dialects(tokenizer):
    engine, http, _, _ = make(tokenizer, max_request_body_bytes=200)
    big = {"model": "embedded", "prompt": "x" * 300}
    openai_style = await http.post("/v1/completions", json=big)
    assert openai_style.status_code == 413
    error = openai_style.json()["error"]
    assert error["code"] == "request_too_large" and "at most 200" in error["message"]
    anthropic_style = await http.post("/v1/messages", json={"model": "embedded", "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "x" * 300}]})
    assert anthropic_style.status_code == 413 and anthropic_style.json()["error"]["type"] == "request_too_large"
    assert engine.requests == []  # nothing reached the engine
    small = await http.post("/v1/completions", json={"model": "embedded", "prompt": "x", "max_tokens": 2})
    assert small.status_code == 200


@pytest.mark.parametrize(("error", "status"), [(EngineOverloaded("queue full"), 429), (EngineDead("gone"), 503)])
async def test_overload_and_dead_engine_carry_retry_after(tokenizer, error, status):
    engine, http, _, _ = make(tokenizer)
    engine.error = error
    response = await http.post("/v1/chat/completions", json={"model": "embedded", "messages": USER})
    assert response.status_code == status and response.headers["retry-after"] == "1"
    bad = await http.post("/v1/chat/completions", json={"model": "embedded", "messages": USER, "n": "2"})
    assert bad.status_code == 400 and "retry-after" not in bad.headers


async def test_metrics_auth_is_opt_in(tokenizer):
    _, http, _, _ = make(tokenizer, api_key="k")
    assert (await http.get("/metrics")).status_code == 200
    _, http, _, _ = make(tokenizer, api_key="k", metrics_require_auth=True)
    assert (await http.get("/metrics")).status_code == 401
    assert (await http.get("/metrics", headers={"x-api-key": "k"})).status_code == 200
    assert (await http.get("/health")).status_code == 200


def test_cli_refuses_metrics_auth_without_a_key():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--metrics-require-auth"])
    args.api_key = None
    with pytest.raises(SystemExit):
        serve_config(args)
    args = parser.parse_args(["--max-request-body-bytes", "0"])
    with pytest.raises(SystemExit):
        serve_config(args)
