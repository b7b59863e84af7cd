"""Progress a user sees (issue 19, item 7): `LLM.generate`'s bar for few prompts, `bench offline`'s bar,
and a `bench serve` table that fits 100 columns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rich.console import Console

from tokenspeed import LLM, SamplingParams
from tokenspeed.bench.report import print_summary, write_summary
from tokenspeed.engine import progress
from tokenspeed.engine.progress import GenerationProgress
from tokenspeed.scheduler.updates import RequestUpdate

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256)


def test_one_long_prompt_gets_a_bar_once_the_call_outlasts_the_delay(llm, capsys, monkeypatch):
    capsys.readouterr()
    llm.generate("def f():", PARAMS)  # quick, under the delay: no bar
    assert "Generating" not in capsys.readouterr().err
    monkeypatch.setattr(progress, "DELAY_S", 0.0)  # as if the call had run that long
    llm.generate("def f():", PARAMS)
    err = capsys.readouterr().err
    assert "Generating (1 prompt)" in err and "6/6" in err and "tok/s" in err
    llm.generate("def f():", PARAMS, use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err


def test_eight_prompts_get_a_bar_at_once(llm, capsys):
    capsys.readouterr()
    llm.generate(["def f():"] * 8, PARAMS)
    assert "Generating (8 prompts)" in capsys.readouterr().err


def test_the_bar_counts_tokens_and_a_request_that_ends_early_hands_back_its_budget():
    with GenerationProgress({"a": 10, "b": 5}, 2, enabled=True) as bar:
        bar.advance([RequestUpdate("a", [1, 2, 3]), RequestUpdate("b", [4, 5], finished=True)])
        assert bar._bar.n == 3 + 5
        bar.advance([RequestUpdate("a", [6], finished=True), RequestUpdate("gone", [7])])
        assert bar._bar.n == bar._bar.total == 15


def test_bench_offline_shows_a_bar_on_stderr_and_one_json_line_on_stdout():
    args = [sys.executable, "-m", "tokenspeed.cli", "bench", "offline", "--num-prompts", "8", "--input-len", "8",
            "--output-len", "4", "--max-model-len", "128"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["num_prompts"] == 8
    assert "Generating (8 prompts)" in done.stderr and "32/32" in done.stderr
    quiet = subprocess.run([*args, "--disable-tqdm"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "Generating" not in quiet.stderr


ROW = dict(label="meta-llama/Llama-3.1-8B-Instruct", concurrency=128, requests=1024, errors=3, tps_per_user=71.25,
           output_tokens_per_s=12345.6, total_tpm_per_gpu=123_456_789.0, output_tpm_per_gpu=1_234_567.0,
           request_throughput=12.34, cache_hit_rate=0.963, ttft_p50_ms=1234.0, ttft_p99_ms=12345.0,
           tpot_p50_ms=14.2, tpot_p99_ms=123.4, itl_p99_ms=1234.5, e2e_p50_ms=123456.0)


@pytest.mark.parametrize("labels", [["one"], ["meta-llama/Llama-3.1-8B-Instruct", "vllm"]])
def test_bench_serve_table_fits_100_columns_and_the_file_keeps_every_column(tmp_path, labels):
    rows = [dict(ROW, label=label, concurrency=c) for label in labels for c in (1, 128)]
    console = Console(width=250, record=True)
    print_summary(rows, console, title="bench serve: agentic vs http://127.0.0.1:8000")
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 100, text
    assert "…" not in text  # no cell cut short
    for value in ("128", "1024", "71.2", "123.5M", "96.3%", "12345", "14.2", "123.4", "1234.5"):
        assert value in text, value
    write_summary(rows, tmp_path / "summary.txt")
    full = (tmp_path / "summary.txt").read_text()
    for header in ("out tok/s", "out TPM/GPU", "req/s", "E2E p50", "123,456,789", "123456"):
        assert header in full, header
