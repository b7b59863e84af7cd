"""The README's commands work: `tokenspeed generate` and `tokenspeed bench offline`."""

from __future__ import annotations

import json
import os
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


def test_kernels_explains_the_choice_for_a_gpu_and_honours_overrides():
    result = tokenspeed("kernels", "--platform", "cuda", "--family", "attention")
    assert result.returncode == 0, result.stderr
    decode = result.stdout.split("\n\n")[0]
    assert decode.startswith("attention.decode [platform=cuda dtype=bfloat16] -> triton")
    assert "reference" in decode and "PORTABLE" in decode

    forced = subprocess.run(
        [sys.executable, "-m", "tokenspeed.cli", "kernels", "--platform", "cuda", "--family", "attention"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TOKENSPEED_KERNEL_ATTENTION_DECODE": "reference"},
    )
    assert "attention.decode [platform=cuda dtype=bfloat16] -> reference: forced by" in forced.stdout


def test_kernels_on_the_cpu_and_bad_arguments():
    result = tokenspeed("kernels", "--trait", "head_dim=64", "--workload", "num_tokens=1-8")
    assert result.returncode == 0, result.stderr
    assert "norm.rms [platform=cpu dtype=float32] -> torch_fp32" in result.stdout
    assert "rejected: platform 'cpu' not in ['cuda']" in result.stdout
    assert tokenspeed("kernels", "--family", "no-such-family").returncode == 2
    bad = tokenspeed("kernels", "--workload", "num_tokens")
    assert bad.returncode == 2 and "key=value" in bad.stderr


def test_speculative_config_on_generate_and_bench_offline():
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    plain = tokenspeed("generate", "x = 1\nx = 1\nx = 1\n", "--max-tokens", "12", "--json")
    fast = tokenspeed("generate", "x = 1\nx = 1\nx = 1\n", "--max-tokens", "12", "--json", "--speculative-config", spec)
    assert fast.returncode == 0, fast.stderr
    assert json.loads(fast.stdout.splitlines()[-1])["token_ids"] == json.loads(plain.stdout.splitlines()[-1])["token_ids"]
    result = tokenspeed("bench", "offline", "--num-prompts", "2", "--input-len", "16", "--output-len", "8",
                        "--speculative-config", spec)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["spec_method"] == "ngram" and report["spec_num_drafts"] >= 0
    assert 0.0 <= report["spec_acceptance_rate"] <= 1.0
    bad = tokenspeed("generate", "x", "--speculative-config", '{"method": "magic"}')
    assert bad.returncode == 2 and "speculative_config['method']" in bad.stderr and "Traceback" not in bad.stderr
