"""The streaming client, calibration, a sweep point and the whole `bench serve` command,
against a small in-test OpenAI-compatible SSE server with a prefix cache."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tokenspeed.bench.agentic import agentic_plan
from tokenspeed.bench.calibrate import calibrate, server_info
from tokenspeed.bench.client import RequestOptions, RequestRecord, stream_request
from tokenspeed.bench.conversation import TextRatios, completion_prompt, system_text
from tokenspeed.bench.sweep import PointSpec, run_point
from tokenspeed.bench.workload import fit_to_context
from tokenspeed.cli import main

CHARS_PER_TOKEN = 4
MESSAGE_FRAMING = "<|m|>"  # costs 2 tokens per message in the fake's tokenization
MAX_CONTEXT = 2048


def _render(body: dict) -> str:
    if "messages" in body:
        return "".join(MESSAGE_FRAMING + m["role"] + ":" + m["content"] for m in body["messages"])
    return body["prompt"]


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams `max_tokens` one-word events; prompt tokens = ceil(chars / 4); caches full prefixes."""

    protocol_version = "HTTP/1.1"
    seen: list[str]
    send_usage = True
    token_delay_s = 0.001
    tokens_per_event = 0  # > 0: events carry this many tokens and, if asked, the running usage

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def _json(self, status: int, document: dict) -> None:
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model", "max_model_len": MAX_CONTEXT}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def _event(self, document: dict | str) -> None:
        payload = document if isinstance(document, str) else json.dumps(document)
        chunk = f"data: {payload}\n\n".encode()
        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        self.wfile.flush()

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = _render(body)
        prompt_tokens = math.ceil(len(prompt) / CHARS_PER_TOKEN)
        if prompt_tokens + body["max_tokens"] > MAX_CONTEXT:
            self._json(400, {"error": {"message": "context length exceeded"}})
            return
        best = max((self._common(prompt, old) for old in type(self).seen), default=0)
        cached = best // CHARS_PER_TOKEN
        type(self).seen.append(prompt)
        chat = self.path == "/v1/chat/completions"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        if self.tokens_per_event:
            self._bunched(body, chat, prompt_tokens)
            return
        for index in range(body["max_tokens"]):
            time.sleep(self.token_delay_s)
            text = f" w{index}"
            finish = "length" if index == body["max_tokens"] - 1 else None
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            self._event({"choices": [{**choice, "finish_reason": finish}]})
        if self.send_usage and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"],
                     "total_tokens": prompt_tokens + body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": cached}}
            self._event({"choices": [], "usage": usage})
        self._event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    def _bunched(self, body: dict, chat: bool, prompt_tokens: int) -> None:
        """Events of `tokens_per_event` tokens; every other one decodes to no text (a tokenizer gap)."""
        continuous = body.get("stream_options", {}).get("continuous_usage_stats")
        done = 0
        while done < body["max_tokens"]:
            time.sleep(self.token_delay_s * self.tokens_per_event)
            done = min(body["max_tokens"], done + self.tokens_per_event)
            text = f" w{done}" if done % (2 * self.tokens_per_event) else ""
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            event: dict = {"choices": [choice]}
            if continuous:
                event["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done}
            self._event(event)
        self._event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    @staticmethod
    def _common(a: str, b: str) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i


@pytest.fixture()
def fake_server() -> Iterator[tuple[str, type[FakeOpenAI]]]:
    handler = type("Handler", (FakeOpenAI,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def _request(url: str, messages, max_tokens: int, api: str = "chat") -> tuple[RequestRecord, str]:
    async def go() -> tuple[RequestRecord, str]:
        async with httpx.AsyncClient(base_url=url) as http:
            record = RequestRecord("s", 0)
            text = await stream_request(http, RequestOptions("fake-model", api), messages, max_tokens, record)
            return record, text

    return asyncio.run(go())


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_stream_request_reads_timing_and_usage(fake_server, api):
    url, _ = fake_server
    messages = [{"role": "user", "content": "x" * 400}]
    first, text = _request(url, messages, 6, api)
    assert first.ok and text == "".join(f" w{i}" for i in range(6))
    assert first.usage_reported and first.output_tokens == 6 and first.finish_reason == "length"
    body = {"messages": messages} if api == "chat" else {"prompt": completion_prompt(messages)}
    assert first.cached_tokens == 0 and first.prompt_tokens == math.ceil(len(_render(body)) / CHARS_PER_TOKEN)
    assert len(first.itl_s) == 5 and all(gap > 0 for gap in first.itl_s)
    assert 0 < first.ttft_s < first.e2e_s and first.tpot_s == pytest.approx((first.e2e_s - first.ttft_s) / 5)
    again, _ = _request(url, messages + [{"role": "user", "content": "more"}], 2, api)
    assert again.cached_tokens >= 100


def test_itl_is_per_token_when_events_carry_several(fake_server):
    """12 tokens in 4 events of 3, half without text: the first event is the TTFT, the other 9 tokens each
    get a third of their event's wait (one gap per text event would give 1)."""
    url, handler = fake_server
    handler.tokens_per_event = 3
    record, _ = _request(url, [{"role": "user", "content": "hi"}], 12)
    assert record.output_tokens == 12 and record.ttft_s is not None
    assert len(record.itl_s) == 9  # 3 events after the first, 3 tokens each
    gaps = sorted(record.itl_s)
    assert gaps[-1] < 3 * gaps[0] + 0.01  # each event's wait split evenly over its tokens


def test_http_error_and_missing_usage(fake_server):
    url, handler = fake_server
    record, text = _request(url, [{"role": "user", "content": "x" * (4 * MAX_CONTEXT)}], 4)
    assert not record.ok and "HTTP 400" in record.error and "context length" in record.error and text == ""
    handler.send_usage = False
    record, _ = _request(url, [{"role": "user", "content": "y"}], 3)
    assert record.ok and not record.usage_reported and record.output_tokens == 3
    dead, _ = _request("http://127.0.0.1:9", [{"role": "user", "content": "y"}], 3)
    assert not dead.ok and "ConnectError" in dead.error


def test_calibration_measures_the_servers_tokenizer(fake_server):
    url, _ = fake_server

    async def go() -> tuple[TextRatios, dict]:
        async with httpx.AsyncClient(base_url=url) as http:
            return await calibrate(http, RequestOptions("fake-model"), 1024), await server_info(http)

    ratios, info = asyncio.run(go())
    for value in (ratios.system, ratios.task, ratios.tool):
        assert value == pytest.approx(CHARS_PER_TOKEN, rel=0.02)
    # Two more messages framed "<|m|>assistant:" and "<|m|>user:": 25 chars, ~6 tokens.
    assert 4 <= ratios.turn_overhead <= 8
    assert info["models"] == ["fake-model"] and info["max_model_len"] == MAX_CONTEXT


def test_sweep_point_replays_sessions_with_growing_cache(fake_server):
    url, handler = fake_server
    ratios = TextRatios(4.0, 4.0, 4.0, 8)
    plan = fit_to_context(agentic_plan(3, seed=2, turns=4), 1024, ratios.turn_overhead)
    prefix = system_text(2, plan.prefix_tokens, ratios)
    spec = PointSpec(plan, plan.sessions, 2, ratios, prefix, "salt", time_scale=0.0, max_context=1024)

    async def go():
        async with httpx.AsyncClient(base_url=url) as http:
            return await run_point(http, RequestOptions("fake-model"), spec)

    run = asyncio.run(go())
    assert len(run.records) == 12 and all(r.ok for r in run.records) and run.duration_s > 0
    for session in plan.sessions:
        mine = sorted((r for r in run.records if r.session_id == session.session_id), key=lambda r: r.turn)
        assert [r.turn for r in mine] == [0, 1, 2, 3]
        assert [r.output_tokens for r in mine] == [t.output_tokens for t in session.turns]
        cached = [r.cached_tokens for r in mine]
        assert cached == sorted(cached) and cached[-1] > cached[0]
        for before, after in zip(mine, mine[1:]):
            assert after.cached_tokens >= before.prompt_tokens - 1, "the whole previous prompt is reused"
    # The fake saw each session's prompts as extensions of one another.
    prompts = [p for p in handler.seen if p.startswith(MESSAGE_FRAMING + "system:" + prefix)]
    assert len(prompts) == 12


def _bench(url: str, out, *extra: str, max_context: str | None = "1024") -> int:
    window = ["--max-context", max_context] if max_context else []
    return main(["bench", "serve", "--base-url", url, "--output-dir", str(out), "--concurrency", "1,3",
                 "--sessions", "2", "--turns", "3", "--time-scale", "0", "--no-progress", *window, *extra])


def test_bench_serve_writes_results_and_overlays(fake_server, tmp_path, capsys):
    url, _ = fake_server
    out = tmp_path / "run"
    assert _bench(url, out, "--label", "ours") == 0
    assert _bench(url, out, "--label", "peer", "--api", "completions", "--workload", "random",
                  "--input-len", "200", "--output-len", "16", max_context=None) == 0
    stdout = capsys.readouterr().out
    assert "TTFT" in stdout and "results.csv" in stdout  # the terminal table, and where the files are
    assert "TPS/user" in (out / "summary.txt").read_text()
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["label"], r["concurrency"]) for r in rows] == [("ours", 1), ("ours", 3), ("peer", 1), ("peer", 3)]
    ours = rows[1]
    assert ours["sessions"] == 3 and ours["requests"] == 9 and ours["errors"] == 0
    assert ours["cache_hit_rate"] > 0.5 and ours["tps_per_user"] > 0 and ours["total_tpm_per_gpu"] > 0
    assert ours["model"] == "fake-model" and ours["server"]["models"] == ["fake-model"]
    # the command given to main(), not the test runner's own command line
    assert ours["command"].startswith(f"tokenspeed bench serve --base-url {url} ")
    assert ours["chars_per_token"]["tool"] == pytest.approx(4, rel=0.05)
    assert rows[2]["cache_hit_rate"] < 0.2, "random prompts share no prefix"
    assert (ours["max_context"], rows[2]["max_context"]) == (1024, MAX_CONTEXT), "default: the server's window"
    with (out / "results.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 4
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    lines = [json.loads(x) for x in (out / "requests-ours.jsonl").read_text().splitlines()]
    for session in {(x["concurrency"], x["session_id"]) for x in lines}:
        turns = sorted((x for x in lines if (x["concurrency"], x["session_id"]) == session), key=lambda x: x["turn"])
        assert [x["cached_tokens"] for x in turns] == sorted(x["cached_tokens"] for x in turns)
    overlay = tmp_path / "overlay.png"
    assert main(["bench", "plot", str(out), "--output", str(overlay)]) == 0
    assert overlay.read_bytes()[:4] == b"\x89PNG"


def test_bench_serve_unreachable_server_is_a_clear_error(tmp_path, capsys):
    assert _bench("http://127.0.0.1:9", tmp_path) == 2
    assert "cannot pick a model" in capsys.readouterr().err


def test_plan_context_grows_sessions_past_the_server_window_and_cuts_them(fake_server, tmp_path):
    """--plan-context: sessions planned for a longer window end before a turn would overflow the server's."""
    url, _ = fake_server
    out = tmp_path / "run"
    assert _bench(url, out, "--turns", "20", "--plan-context", str(4 * MAX_CONTEXT), max_context=None) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(r["max_context"], r["plan_context"]) for r in rows} == {(MAX_CONTEXT, 4 * MAX_CONTEXT)}
    assert all(r["errors"] == 0 for r in rows) and rows[-1]["sessions_cut"] > 0
    lines = [json.loads(x) for x in next(out.glob("requests-*.jsonl")).read_text().splitlines()]
    assert max(x["prompt_tokens"] + x["output_tokens"] for x in lines) <= MAX_CONTEXT
