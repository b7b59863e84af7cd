"""`benchmarks/dp_attention_decode.py` on the CPU with a tiny DeepSeek-V3 checkpoint: every mode runs and is written.

The benchmark measures on GPUs; this keeps it from rotting between GPU runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.checkpoints import make_deepseek_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import dp_attention_decode  # noqa: E402


def test_dp_attention_benchmark_runs_every_mode_on_the_cpu(tmp_path: Path) -> None:
    folder = make_deepseek_checkpoint("deepseek_v3", tmp_path / "dsv3")
    out = tmp_path / "dp.json"
    argv = ["--model", str(folder), "--key", "tiny", "--batch", "3", "--input-len", "12", "--output-len", "3",
            "--repeats", "1", "--max-model-len", "64", "--device", "cpu", "--dtype", "float32", "--out", str(out)]
    assert dp_attention_decode.main(argv) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert {"tiny_tp1_bs3_tpot_ms", "tiny_tp2_bs3_tpot_ms", "tiny_dp2_bs3_tpot_ms", "tiny_dp2_vs_tp2"} <= set(metrics)
