"""Stopping `tokenspeed serve` mid-stream: Ctrl-C aborts at once and quietly; SIGTERM drains, then aborts.

Each test starts its own server (it stops it). The streams must end
properly (a last chunk with `finish_reason: "abort"` and `[DONE]`), not be
cut, and the server's output must hold no traceback.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx2
import pytest

from tests.test_api_server import start_server, stop_server


@pytest.fixture
def server(tmp_path):
    # A stream of 4000 tokens outlasts a 0.5 s drain (the tiny model streams about 1000 a second on the CPU).
    running = start_server(tmp_path / "server.log", "--max-model-len", "4096", "--drain-timeout", "0.5")
    yield running
    stop_server(running)


def _stream_in_background(url: str, result: dict[str, object], started: threading.Event) -> threading.Thread:
    def run() -> None:
        body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        lines = []
        with httpx2.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started.set()
        result["lines"] = lines

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _finish_reasons(lines: list[str]) -> list[str]:
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]


@pytest.mark.parametrize(("sig", "limit_s"), [(signal.SIGINT, 2.0), (signal.SIGTERM, 4.0)], ids=["sigint", "sigterm"])
def test_stop_mid_stream_ends_streams_and_exits_quietly(server, sig, limit_s):
    result: dict[str, object] = {}
    started = threading.Event()
    thread = _stream_in_background(server.url, result, started)
    assert started.wait(60)
    time.sleep(0.3)
    stopped_at = time.monotonic()
    server.proc.send_signal(sig)
    assert server.proc.wait(timeout=30) == 0
    took = time.monotonic() - stopped_at
    thread.join(timeout=30)
    log = server.log.read_text()
    assert took < limit_s, f"exit took {took:.1f} s\n{log[-2000:]}"
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    lines = result["lines"]
    assert lines[-1] == "[DONE]" and _finish_reasons(lines) == ["abort"]
