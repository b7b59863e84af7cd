"""Acceptance: `bench serve` against a live `tokenspeed serve` with the embedded tiny model.

Small on purpose (2 sessions x 3 turns, concurrency 1 and 2, 1K context):
it proves the tool and the server agree end to end -- streaming, usage,
prefix-cache accounting -- not how fast either is.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tokenspeed.cli import main

PAGE_SIZE = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def live_server(tmp_path_factory) -> Iterator[str]:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenspeed.cli", "serve", "--port", str(port), "--max-model-len", "1024",
         "--page-size", str(PAGE_SIZE), "--disable-access-log"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"server exited: {log_path.read_text()[-2000:]}"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start in 180 s"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def test_bench_serve_against_live_server(live_server, tmp_path, capsys):
    out = tmp_path / "results"
    code = main(["bench", "serve", "--base-url", live_server, "--output-dir", str(out), "--label", "tokenspeed",
                 "--workload", "agentic", "--concurrency", "1,2", "--sessions", "2", "--turns", "3",
                 "--max-context", "1024", "--time-scale", "0", "--no-progress"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    table = printed.out.split("results in ")[0]
    assert max(map(len, table.splitlines())) <= 100, table  # the terminal table fits
    assert "warning" not in printed.err  # the embedded tokenizer covers the embedded model's vocabulary
    assert "out TPM/GPU" in (out / "summary.txt").read_text()  # the full table is in the files
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for row in rows:
        assert row["requests"] == 6 and row["errors"] == 0 and row["sessions_cut"] == 0
        assert row["prompt_tokens"] > 0 and row["output_tokens"] >= 6
        assert row["tps_per_user"] > 0 and row["total_tpm_per_gpu"] > 0 and row["ttft_p50_ms"] > 0
        assert row["cache_hit_rate"] > 0.5, "the shared prefix and each session's history are reused"
        assert row["model"] == "embedded" and row["server"]["models"] == ["embedded"]
    with (out / "results.csv").open() as handle:
        assert [r["label"] for r in csv.DictReader(handle)] == ["tokenspeed", "tokenspeed"]
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"

    records = [json.loads(line) for line in (out / "requests-tokenspeed.jsonl").read_text().splitlines()]
    assert len(records) == 12 and all(r["usage_reported"] for r in records)
    for key in {(r["concurrency"], r["session_id"]) for r in records}:
        turns = sorted((r for r in records if (r["concurrency"], r["session_id"]) == key), key=lambda r: r["turn"])
        cached = [r["cached_tokens"] for r in turns]
        assert cached == sorted(cached) and cached[-1] > cached[0], f"cached tokens must grow: {cached}"
        for before, after in zip(turns, turns[1:]):
            # Every full page of the previous prompt is served from the cache.
            assert after["cached_tokens"] >= before["prompt_tokens"] // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE
            assert after["prompt_tokens"] > before["prompt_tokens"] + before["output_tokens"] - 2
