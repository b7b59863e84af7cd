"""`benchmarks/fp8_e2e.py --smoke` runs every section on the CPU (shrunk presets) and writes its JSON.

The benchmark measures on the H200 only; this keeps the script working between GPU runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fp8_e2e_smoke_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "fp8_e2e.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8_e2e.py"), "--smoke", "--out", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    metrics = doc["metrics"]
    assert "failed" not in metrics
    assert {"fp8", "bf16", "bf16_over_fp8", "targets"} <= set(metrics["llama"])
    assert metrics["llama"]["fp8"]["weight_bytes_per_token"] < metrics["llama"]["bf16"]["weight_bytes_per_token"]
    dense = metrics["qwen3_dense"]
    assert {"block_fp8", "online_fp8", "bf16", "bf16_over_block_fp8"} <= set(dense)
    assert dense["block_fp8"]["weight_bytes_per_token"] < dense["bf16"]["weight_bytes_per_token"]
    assert all(dense[name]["roofline_ratio"] > 0 for name in ("block_fp8", "online_fp8", "bf16"))
    batch = metrics["llama_batch"]
    variants = ("fp8", "fp8_no_skinny", "bf16")
    assert {*variants, "skinny_speedup"} <= set(batch)
    assert set(batch["skinny_speedup"]) == {"bs2", "bs4"}
    assert all(batch[name]["bs4"]["tpot_ms"] > 0 for name in variants)
    assert {"bs1", "bs2", "decode_tiles"} <= set(metrics["qwen3_moe"]) and "roofline_ratio" in metrics["qwen3_moe"]["bs1"]
    kv = metrics["kv_long"]
    assert kv["fp8"]["kv_bytes_per_token"] * 4 == kv["bf16"]["kv_bytes_per_token"]  # fp32 on the CPU
    assert kv["fp8"]["kv_pages"] > kv["bf16"]["kv_pages"]
    assert kv["fp8"]["roofline_ratio"] > 0 and "fp8_attention_launches" in kv
