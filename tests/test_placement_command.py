"""`tokenspeed placement`: the printed plan is stable (golden text) and bad input is a clear error.

The goldens in `tests/data/placement/` are the exact output for shipped
presets; a change to the compiler's choices or the plan's format shows up
there as a readable diff. After a deliberate change, rewrite them with
`TOKENSPEED_UPDATE_GOLDEN=1 pytest tests/test_placement_command.py` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenspeed.cli import main

GOLDEN = Path(__file__).parent / "data" / "placement"
CASES = {
    "llama-3.1-8b-tp2": ["llama-3.1-8b", "--tp", "2"],
    "llama-3.1-8b-tp1": ["llama-3.1-8b", "--tp", "1"],
    "qwen3-30b-a3b-tp4-ep4": ["qwen3-30b-a3b", "--tp", "4", "--ep", "4"],
    "qwen3-30b-a3b-fp8-tp4-ep4": ["qwen3-30b-a3b-fp8", "--tp", "4", "--ep", "4"],  # projections at one byte
    "deepseek-v2-lite-tp4-dp-attention": ["deepseek-v2-lite", "--tp", "4", "--dp-attention"],
    "moonlight-tp8-dp-attention-alltoall": [
        "moonlight-16b-a3b", "--tp", "8", "--dp-attention", "--enable-expert-parallel", "--all2all-backend", "alltoall",
    ],
    "embedded-tp2": ["embedded", "--tp", "2"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_printed_plan_matches_golden(case: str, capsys: pytest.CaptureFixture[str]):
    assert main(["placement", *CASES[case]]) == 0
    text = capsys.readouterr().out
    path = GOLDEN / f"{case}.txt"
    if os.environ.get("TOKENSPEED_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text()


def test_golden_plans_say_what_the_issue_asks():
    tp2 = (GOLDEN / "llama-3.1-8b-tp2.txt").read_text()
    layer_ops = tp2.split("layers 0-31:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in layer_ops] == [
        "fused_allreduce_rmsnorm", "compute", "fused_allreduce_rmsnorm", "compute",
    ]
    tp1 = (GOLDEN / "llama-3.1-8b-tp1.txt").read_text()
    assert "collectives: 0;" in tp1
    assert {line.split()[0] for line in tp1.splitlines() if line.startswith("  ") and "->" in line} == {"compute"}
    moe = (GOLDEN / "qwen3-30b-a3b-tp4-ep4.txt").read_text()
    assert "fused_allreduce_rmsnorm        input_layernorm                    MOE_TP_EP x4" in moe
    alltoall = (GOLDEN / "moonlight-tp8-dp-attention-alltoall.txt").read_text()
    assert "all_to_all dispatch" in alltoall and "all_to_all combine" in alltoall


def test_bad_parallel_options_and_models_are_clear_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    assert main(["placement", "llama-3.1-8b", "--tp", "3"]) == 2
    assert "error: LlamaForCausalLM cannot run with tensor_parallel_size=3: ATTN_TP=3" in capsys.readouterr().err
    assert main(["placement", "llama-3.1-8b", "--tp", "2", "--ep", "2"]) == 2
    assert "expert parallelism needs a mixture-of-experts model" in capsys.readouterr().err
    assert main(["placement", "qwen3-30b-a3b-fp8", "--tp", "4"]) == 2  # 192 expert rows a rank: cuts 128-row blocks
    assert "rows [192, 384) start inside a 128-row FP8 block" in capsys.readouterr().err
    assert main(["placement", str(tmp_path / "nowhere")]) == 2
    assert "neither a preset" in capsys.readouterr().err
