"""A server whose engine process dies must fail fast and exit; a full waiting queue answers 429.

Its own server (the test kills it): `--max-num-seqs 1 --max-waiting-requests 1`,
so a burst of requests overflows the queue.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx2
import pytest

from tests.test_api_server import start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dying") / "server.log"
    running = start_server(log, "--max-num-seqs", "1", "--max-waiting-requests", "1")
    yield running
    stop_server(running)


def body(max_tokens: int, **extra) -> dict:
    return {"model": "embedded", "prompt": "count with me", "max_tokens": max_tokens, "ignore_eos": True, **extra}


def test_a_full_queue_answers_429(server):
    async def run() -> list[int]:
        async with httpx2.AsyncClient(base_url=server.url, timeout=60) as client:
            responses = await asyncio.gather(*(client.post("/v1/completions", json=body(40)) for _ in range(8)))
        for response in responses:
            if response.status_code == 429:
                assert response.json()["error"]["type"] == "rate_limit_error"
        return [r.status_code for r in responses]

    statuses = asyncio.run(run())
    assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses


def test_engine_death_fails_fast_then_the_server_exits(server):
    with httpx2.Client(base_url=server.url, timeout=30) as client:
        engine_pid = client.get("/debug/kv").json()["engine_pid"]
        with client.stream("POST", "/v1/completions", json=body(1000, stream=True)) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(engine_pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(lines)  # the in-flight stream ends with an error event, it does not hang
        assert any('"service_unavailable_error"' in line for line in rest), rest[-3:]
        while client.get("/health").status_code != 503:
            assert time.monotonic() - killed < 1.0, "/health still passes a second after the engine died"
        refused = client.post("/v1/completions", json=body(4))
        assert refused.status_code == 503 and time.monotonic() - killed < 1.0
        assert refused.json()["error"]["type"] == "service_unavailable_error"
    assert server.proc.wait(timeout=30) != 0, server.log.read_text()[-3000:]
