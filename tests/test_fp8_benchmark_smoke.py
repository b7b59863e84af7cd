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


def _smoke(script: str, out: Path, *args: str) -> dict:
    """Run `benchmarks/<script> --smoke ... --out <out>` in a fresh process; the JSON it wrote."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args, "--out", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def test_fp8_benchmark_smoke_writes_all_sections(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    doc = _smoke("fp8_kernels.py", out)
    assert set(doc) == {"command", "device", "date", "metrics"}
    metrics = doc["metrics"]
    assert {"ceilings", "gemm", "gemv", "decode_attention", "moe"} <= set(metrics)
    assert metrics["gemm"]["qkv"]["2"]["selected"] == "triton_gemv"  # 2-16 tokens: the skinny GEMM
    assert metrics["gemm"]["qkv"]["20"]["selected"] == "scaled_mm"
    assert set(metrics["gemv"]) == {"qkv", "down"} and metrics["gemv"]["qkv"]["config"].startswith("Fp8GemvConfig")
    sweep = metrics["decode_attention"]["split_sweep"]["batch 2"]  # the smoke shape's 2 rows, 1 to 4 splits
    assert set(sweep["bw_fraction_by_splits"]) == {"1", "2", "4"} and sweep["default_splits"] == 1
    assert metrics["moe"]["by_tokens"]["1"]["operands"] == "w8a16"
    assert metrics["moe"]["by_tokens"]["1"]["tiles"].startswith("TileConfig")
    assert out.with_suffix(".md").exists()


def test_gemv_stack_smoke_times_every_launch_shape_and_bf16(tmp_path: Path) -> None:
    table = tmp_path / "shapes.json"
    metrics = _smoke("gemv_stack.py", tmp_path / "gemv_stack.json", "--forms", "o,gate_up",
                     "--write-shapes", str(table))["metrics"]  # fmt: skip
    from tokenspeed.kernels.gemm.fp8_gemv_shapes import read_table
    from tokenspeed.kernels.gemm.fp8_gemv_triton import Fp8GemvConfig, choose_config, launch_shapes

    written = read_table(table)
    for form in ("o", "gate_up"):
        row = metrics["forms"][form]
        assert set(row["fp8_us"]) == {repr(c) for c in launch_shapes(128)}  # every launch shape ran
        # The smoke's K of 128 is one 128-wide block: the per-channel path, whose gate/up shape differs.
        chosen = choose_config(128, silu_mul=form == "gate_up", block_size=(128, 128), norm=form == "gate_up",
                               residual=form == "o")
        assert row["fp8_chosen_config"] == repr(chosen)
        assert row["best_fp8_config"] in row["fp8_us"] and row["bf16_us"] > 0
        # --write-shapes: the form's best shape under its key, as the engine reads it back
        assert repr(Fp8GemvConfig(**written[row["shapes_key"]])) == row["best_fp8_config"]
    assert set(written) == {"residual/128/rows", "silu_mul/128/rows"}
    assert "layer" not in metrics  # only with all four forms


def test_gemv_stack_per_channel_times_per_channel_weights(tmp_path: Path) -> None:
    metrics = _smoke("gemv_stack.py", tmp_path / "gemv_stack.json", "--forms", "down", "--skip-shapes",
                     "--per-channel")["metrics"]  # fmt: skip
    row = metrics["forms"]["down"]
    assert metrics["weight_scales"] == "per channel"
    assert row["fp8_weight_bytes"] == 64 * 256 + 64 * 4  # an fp32 scale a row (blocks: two in all)
    assert row["fp8_us"] == {} and row["fp8_chosen_us"] > 0


def test_skinny_stack_smoke_times_every_launch_shape_against_the_gemm_and_bf16(tmp_path: Path) -> None:
    table = tmp_path / "shapes.json"
    metrics = _smoke("fp8_skinny_stack.py", tmp_path / "skinny_stack.json", "--tokens", "2,3",
                     "--write-shapes", str(table))["metrics"]  # fmt: skip
    from tokenspeed.kernels.gemm.fp8_gemv_shapes import read_table
    from tokenspeed.kernels.gemm.fp8_skinny_triton import SkinnyConfig, skinny_shapes

    written = read_table(table)
    for form in ("qkv", "o", "gate_up", "down"):
        by_tokens = metrics["forms"][form]
        for row in by_tokens.values():
            assert set(row["skinny"]) == {repr(c) for c in skinny_shapes()}  # every launch shape ran
            assert row["skinny_chosen_us"] > 0 and row["gemm_us"] > 0 and row["bf16_us"] > 0
            assert row["skinny_chosen_from"] == "launch tuner"  # no table given to the run
        # --write-shapes: the shape with the least time over both token counts, under its weight shape's key
        [key] = [key for key in written if key.startswith(f"skinny/{SMOKE_SKINNY_WEIGHTS[form]}/")]
        summed = {c: by_tokens["2"]["skinny"][c] + by_tokens["3"]["skinny"][c] for c in by_tokens["2"]["skinny"]}
        assert repr(SkinnyConfig(**written[key])) == min(summed, key=summed.__getitem__)
    assert len(written) == 4


SMOKE_SKINNY_WEIGHTS = {"qkv": "96x128", "o": "64x128", "gate_up": "256x128", "down": "64x256"}  # gemv_stack.SMOKE_FORMS


def test_moe_decode_stack_smoke_times_the_tuned_pick_and_every_tile(tmp_path: Path) -> None:
    metrics = _smoke("moe_decode_stack.py", tmp_path / "moe_stack.json", "--tokens", "1")["metrics"]
    from tokenspeed.kernels.moe.experts_fp8_triton import decode_tile_candidates

    row = metrics["by_tokens"]["1"]
    assert {repr(t) for t in decode_tile_candidates(())} < set(row["us"])  # every candidate ran, and more
    assert row["us"]["tuned"] > 0 and row["bf16_us"] > 0 and row["tuned_config"].startswith("TileConfig")
    assert row["best_config"] in row["us"] and row["experts_hit"] == 2.0  # top-2 of one token
