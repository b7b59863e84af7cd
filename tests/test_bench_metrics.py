"""Metrics math, the Pareto frontier, and the CSV/JSON/PNG writers of `bench serve`."""

from __future__ import annotations

import csv
import json
import math
import random

import numpy as np
import pytest

from tokenspeed.bench.client import RequestRecord
from tokenspeed.bench.metrics import percentile, summarize
from tokenspeed.bench.pareto import frontier, plot_pareto, series_by_label
from tokenspeed.bench.plot import combine
from tokenspeed.bench.results_io import read_rows, write_requests, write_rows


def test_percentile_matches_numpy_linear():
    rng = random.Random(1)
    for size in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))


def _record(turn: int, ttft: float, e2e: float, prompt: int, cached: int, out: int, error: str | None = None):
    return RequestRecord("s0", turn, ttft_s=ttft, e2e_s=e2e, itl_s=[0.01] * max(out - 1, 0),
                         prompt_tokens=prompt, cached_tokens=cached, output_tokens=out,
                         usage_reported=True, error=error)


def test_summarize_definitions():
    records = [
        _record(0, ttft=0.1, e2e=1.1, prompt=1000, cached=0, out=101),  # TPOT 10 ms
        _record(1, ttft=0.2, e2e=0.6, prompt=1500, cached=1000, out=21),  # TPOT 20 ms
        _record(2, ttft=0.0, e2e=9.9, prompt=9999, cached=0, out=5, error="HTTP 500: boom"),
        _record(3, ttft=0.3, e2e=0.3, prompt=10, cached=0, out=1),  # one token: no TPOT
    ]
    m = summarize(records, concurrency=4, sessions=2, duration_s=2.0, gpus=2)
    assert (m.requests, m.errors) == (4, 1)
    assert m.prompt_tokens == 2510 and m.cached_tokens == 1000 and m.output_tokens == 123
    assert m.latency_ms["tpot"]["mean"] == pytest.approx(15.0)
    assert m.tps_per_user == pytest.approx(1000 / 15.0)
    assert m.output_tokens_per_s == pytest.approx(123 / 2.0)
    assert m.total_tpm_per_gpu == pytest.approx((2510 + 123) / 2.0 * 60 / 2)
    assert m.output_tpm_per_gpu == pytest.approx(123 / 2.0 * 60 / 2)
    assert m.request_throughput == pytest.approx(3 / 2.0)
    assert m.cache_hit_rate == pytest.approx(1000 / 2510)
    assert m.latency_ms["ttft"]["p50"] == pytest.approx(200.0)
    assert m.latency_ms["e2e"]["p99"] == pytest.approx(float(np.percentile([1100, 600, 300], 99)))
    assert m.latency_ms["itl"]["mean"] == pytest.approx(10.0)
    flat = m.flat()
    assert flat["ttft_p90_ms"] == m.latency_ms["ttft"]["p90"] and "latency_ms" not in flat


def test_summarize_with_no_successful_request_is_nan_not_a_crash():
    m = summarize([_record(0, 0.1, 0.2, 5, 0, 3, error="x")], 1, 1, 1.0)
    assert m.errors == 1 and math.isnan(m.tps_per_user) and m.cache_hit_rate == 0.0


def test_frontier_keeps_only_undominated_points():
    points = [(10, 100), (20, 90), (15, 80), (30, 10), (20, 90), (5, 100)]
    assert frontier(points) == [0, 1, 3, 4]


def _rows(label: str, base: float):
    return [
        {"label": label, "concurrency": c, "tps_per_user": 200.0 / c, "total_tpm_per_gpu": base * c,
         "output_tpm_per_gpu": base * c / 10, "workload": "agentic", "server": {"models": ["m"]},
         "ttft_p99_ms": float("nan")}
        for c in (1, 2, 4)
    ]


def test_results_merge_by_label_and_round_trip(tmp_path):
    write_rows(tmp_path, _rows("ours", 1000.0))
    write_rows(tmp_path, _rows("peer", 500.0))
    merged = write_rows(tmp_path, _rows("ours", 2000.0)[:2])  # a rerun replaces only its own label
    assert [(r["label"], r["concurrency"]) for r in merged] == [
        ("ours", 1), ("ours", 2), ("peer", 1), ("peer", 2), ("peer", 4)]
    rows = read_rows(tmp_path)
    assert rows[0]["total_tpm_per_gpu"] == 2000.0 and rows[0]["ttft_p99_ms"] is None
    document = json.loads((tmp_path / "results.json").read_text())  # strict JSON: no NaN
    assert document["schema_version"] == 1
    with (tmp_path / "results.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 5 and list(table[0])[:3] == ["label", "workload", "concurrency"]
    assert json.loads(table[0]["server"]) == {"models": ["m"]} and table[0]["ttft_p99_ms"] == ""


def test_requests_jsonl(tmp_path):
    path = write_requests(tmp_path, "our label", [(2, [_record(0, 0.1, 0.5, 10, 4, 3)])])
    assert path.name == "requests-our_label.jsonl"
    line = json.loads(path.read_text())
    assert line["concurrency"] == 2 and line["cached_tokens"] == 4 and line["label"] == "our label"


def test_pareto_png_and_overlay(tmp_path):
    rows = _rows("ours", 1000.0) + _rows("peer", 500.0)
    rows.append({"label": "peer", "concurrency": 8, "tps_per_user": float("nan"), "total_tpm_per_gpu": 1.0,
                 "output_tpm_per_gpu": 1.0})
    assert [p[2] for p in series_by_label(rows, "total_tpm_per_gpu")["peer"]] == [1, 2, 4]
    path = plot_pareto(rows, tmp_path / "sub" / "pareto.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_rows(tmp_path / "a", _rows("ours", 1.0) + _rows("peer", 1.0))
    write_rows(tmp_path / "b", _rows("ours", 2.0))
    labels = {r["label"] for r in combine([tmp_path / "a", tmp_path / "b"])}
    assert labels == {"a/ours", "b/ours", "peer"}
