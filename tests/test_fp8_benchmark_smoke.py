"""`benchmarks/fp8_kernels.py --smoke` runs on the CPU (interpreter, tiny shapes) and writes every section.

The benchmark itself only measures on the GPU; this keeps the script from
rotting between GPU runs (an API change in a kernel breaks it here first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_fp8_benchmark_smoke_writes_all_sections(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8_kernels.py"), "--smoke", "--out", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc) == {"command", "device", "date", "metrics"}
    metrics = doc["metrics"]
    assert {"ceilings", "gemm", "gemv", "decode_attention", "moe"} <= set(metrics)
    assert metrics["gemm"]["qkv"]["2"]["selected"] == metrics["gemm"]["qkv"]["20"]["selected"] == "scaled_mm"
    assert set(metrics["gemv"]) == {"qkv", "down"} and metrics["gemv"]["qkv"]["config"].startswith("Fp8GemvConfig")
    assert metrics["moe"]["by_tokens"]["1"]["operands"] == "w8a16"
    assert metrics["moe"]["by_tokens"]["1"]["tiles"].startswith("TileConfig")
    assert out.with_suffix(".md").exists()
