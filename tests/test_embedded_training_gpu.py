"""The training command on the GPU: compiled bf16 steps, the time budget, and eval-ppl through the GPU engine.

Run before the full training run (`make test-gpu PYTEST_ARGS=tests/test_embedded_training_gpu.py`):
it fails if torch.compile falls back to eager on this machine (the full run
would then be several times slower), if a time-budgeted phase overruns, or if
the engine's prompt log-probabilities on the GPU disagree with transformers.
"""

from __future__ import annotations

import json

import pytest
import torch

from tokenspeed import LLM
from tokenspeed.eval_ppl import engine_metrics, transformers_metrics
from tokenspeed.models.embedded.training import run
from tokenspeed.models.embedded.training.corpus import CorpusOptions, held_out_windows

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke-gpu")
    assert run.main(["--out", str(out), "--smoke", "--device", "cuda", "--compile", "on"]) == 0
    return out


def test_compiled_smoke_run_on_the_gpu(smoke):
    record = json.loads((smoke / "train_embedded.json").read_text())
    for log in (smoke / "logs").glob("*.jsonl"):
        assert "compile_failed" not in log.read_text(), log.read_text()
    for name in ("embedded", "embedded-moe"):
        assert record["metrics"][name]["transformers_max_logit_diff"] < 1e-3
    print(json.dumps(record["phases"]))


def test_time_budgeted_run_keeps_its_budget(tmp_path):
    budget = 90.0
    args = ["--out", str(tmp_path), "--models", "embedded", "--time-budget", str(budget), "--batch-size", "32",
            "--seq-len", "256", "--eval-windows", "8", "--sources", "stdlib", "--no-verify"]
    assert run.main(args) == 0
    record = json.loads((tmp_path / "train_embedded.json").read_text())
    print(json.dumps(record["phases"]))
    assert record["metrics"]["total_wall_time_s"] < budget + 15
    for phase in record["phases"].values():
        assert not phase["stopped_early"] and phase["steps"] > 20


@pytest.mark.parametrize("name", ["embedded", "embedded-moe"])
def test_eval_ppl_on_the_gpu_engine_equals_transformers_in_fp32(smoke, name):
    folder = smoke / name
    options = CorpusOptions(sources=("stdlib",), held_out_per_mille=200, total_budget_bytes=400_000)
    windows, token_bytes, _ = held_out_windows(folder / "tokenizer.json", options, 32, 8)
    llm = LLM(str(folder), skip_tokenizer_init=True, device="cuda", dtype="float32", show_progress=False)
    ours = engine_metrics(llm, windows, token_bytes)
    theirs = transformers_metrics(folder, windows, token_bytes, dtype=torch.float32, device="cuda")
    assert abs(ours["bits_per_byte"] - theirs["bits_per_byte"]) < 1e-3, (ours, theirs)
