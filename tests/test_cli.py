"""The README's commands work: `tokenspeed generate` and `tokenspeed bench offline`."""

from __future__ import annotations

import json
import subprocess
import sys


def tokenspeed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenspeed.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_with_embedded_model():
    result = tokenspeed("generate", "def fib(n):", "--max-tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["prompt"] == "def fib(n):" and len(line["token_ids"]) <= 8


def test_bench_offline_prints_throughput_json():
    result = tokenspeed("bench", "offline", "--num-prompts", "4", "--input-len", "32", "--output-len", "8")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["num_prompts"] == 4
    for key in ("requests_per_s", "input_tokens_per_s", "output_tokens_per_s"):
        assert report[key] > 0


def test_bad_model_is_a_clear_error_not_a_traceback(tmp_path):
    result = tokenspeed("generate", "x", "--model", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
