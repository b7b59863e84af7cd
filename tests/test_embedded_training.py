"""The training command on the CPU (`--smoke`): deterministic, and its folders load everywhere alike.

A smoke run trains all three phases for a few steps on a small stdlib
sample; its checkpoint folders must load in transformers and in our engine
with identical greedy tokens, and the engine's held-out bits per byte
(`tokenspeed eval-ppl`, through prompt_logprobs) must equal transformers'
on the same windows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoints import load_hf
from tokenspeed import LLM, SamplingParams
from tokenspeed.cli import main as cli_main
from tokenspeed.eval_ppl import engine_metrics, transformers_metrics
from tokenspeed.models.embedded.materialize import package_config, package_dir
from tokenspeed.models.embedded.training import run
from tokenspeed.models.embedded.training.corpus import CorpusOptions, held_out_windows
from tokenspeed.models.embedded.training.eagle import EagleHead


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    assert run.main(["--out", str(out), "--smoke", "--seed", "3"]) == 0
    return out


def test_smoke_run_is_deterministic(tmp_path):
    args = ["--smoke", "--models", "embedded", "--steps-eagle", "2", "--no-verify", "--seed", "5"]
    for name in ("a", "b"):
        assert run.main(["--out", str(tmp_path / name), *args]) == 0

    def losses(name):
        lines = (tmp_path / name / "logs" / "embedded.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines if '"loss"' in line]

    assert losses("a") == losses("b") and len(losses("a")) >= 3
    for weights in ("embedded/model.safetensors", "embedded/eagle/model.safetensors"):
        assert _sha(tmp_path / "a" / weights) == _sha(tmp_path / "b" / weights)
    first, second = (json.loads((tmp_path / n / "train_embedded.json").read_text()) for n in "ab")
    for key in ("heldout_bits_per_byte", "heldout_top1", "training_tokens"):
        assert first["metrics"]["embedded"][key] == second["metrics"]["embedded"][key]
    other = tmp_path / "c"
    assert run.main(["--out", str(other), *args[:-1], "6"]) == 0
    assert _sha(other / "embedded/model.safetensors") != _sha(tmp_path / "a" / "embedded/model.safetensors")


def test_record_has_what_the_results_file_needs(smoke):
    record = json.loads((smoke / "train_embedded.json").read_text())
    assert {"command", "device", "date", "data_files_sha256", "metrics", "corpus", "phases"} <= set(record)
    dense, moe = record["metrics"]["embedded"], record["metrics"]["embedded-moe"]
    for entry in (dense, moe):
        assert {"params", "training_tokens", "wall_time_s", "heldout_bits_per_byte", "heldout_top1"} <= set(entry)
        assert entry["transformers_max_logit_diff"] < 1e-3
    assert {"next_next_top1", "next_next_agreement"} <= set(dense["eagle"]) | set(moe["mtp"])
    assert set(moe["mtp"]) == {"next_next_top1", "next_next_agreement"}
    assert record["phases"]["embedded"]["steps"] == 8 and not record["phases"]["embedded"]["stopped_early"]
    assert (smoke / "logs" / "eagle.jsonl").is_file()
    assert not (smoke / "package").exists(), "smoke shapes must never be offered for commit"
    assert (smoke / "embedded" / "eagle" / "config.json").is_file()
    for asset in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert (smoke / "embedded-moe" / asset).is_file()


@pytest.mark.parametrize("name", ["embedded", "embedded-moe"])
def test_transformers_and_our_engine_give_the_same_greedy_tokens(smoke, name):
    folder = smoke / name
    llm = LLM(str(folder), max_model_len=256, show_progress=False)
    if name == "embedded-moe":  # the trained MTP layer is loaded and kept, not dropped
        assert len(llm.core.executor.model.model.layers) == llm.core.executor.model_config.num_layers + 1
    prompts = ["def fibonacci(n):", "import os\n\ndef ", "class Stack:"]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    model = load_hf(folder)
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            theirs = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert out.outputs[0].token_ids == theirs[0, ids.shape[1]:].tolist(), prompt


@pytest.mark.parametrize("name", ["embedded", "embedded-moe"])
def test_eval_ppl_through_the_engine_equals_transformers(smoke, name):
    folder = smoke / name
    options = CorpusOptions(sources=("stdlib",), held_out_per_mille=200, total_budget_bytes=400_000)
    windows, token_bytes, _ = held_out_windows(folder / "tokenizer.json", options, 48, 6)
    llm = LLM(str(folder), skip_tokenizer_init=True, show_progress=False)
    ours = engine_metrics(llm, windows, token_bytes)
    theirs = transformers_metrics(folder, windows, token_bytes, dtype=torch.float32, device="cpu")
    assert ours["tokens"] == theirs["tokens"] == 6 * 47 and ours["bytes"] == theirs["bytes"] > 0
    assert abs(ours["bits_per_byte"] - theirs["bits_per_byte"]) < 1e-3
    assert ours["top1"] == theirs["top1"]


def test_eval_ppl_command(smoke, tmp_path, capsys):
    out = tmp_path / "eval.json"
    status = cli_main(["eval-ppl", "--model", str(smoke / "embedded"), "--window", "32", "--max-windows", "3",
                       "--sources", "stdlib", "--compare-transformers", "--output", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    assert result["windows"] == 3 and result["bits_per_byte_abs_diff"] < 1e-3
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result


def test_eagle_only_run_trains_a_head_on_the_shipped_weights(tmp_path):
    """`--models eagle`: the shipped `embedded` weights are read, never written; the head has the shipped shape."""
    shipped = package_dir() / "model.safetensors"
    before = _sha(shipped)
    args = ["--out", str(tmp_path), "--smoke", "--models", "eagle", "--steps-eagle", "2", "--seed", "1"]
    assert run.main(args) == 0
    assert _sha(shipped) == before
    record = json.loads((tmp_path / "train_embedded.json").read_text())
    assert set(record["metrics"]) == {"embedded", "total_wall_time_s"} and set(record["metrics"]["embedded"]) == {"eagle"}
    eagle = record["metrics"]["embedded"]["eagle"]
    assert eagle["target_heldout_top1"] > 0.2, "the trained target, not random weights"
    assert eagle["recipe"]["name"] == run.DEFAULT_EAGLE_RECIPE and record["phases"]["eagle"]["steps"] == 2
    config = json.loads((tmp_path / "embedded" / "eagle" / "config.json").read_text())
    assert config == package_config("embedded", draft=True)
    EagleHead(config).load_hf_state_dict(load_file(str(tmp_path / "embedded" / "eagle" / "model.safetensors")))
    assert not (tmp_path / "embedded" / "model.safetensors").exists()
    assert not (tmp_path / "package").exists(), "smoke weights are never offered for commit"


def test_merged_record_keeps_the_base_models_and_the_heads_own_run():
    base = json.loads((Path(__file__).resolve().parent.parent / run.BASE_RECORD).read_text())
    original = json.dumps(base)
    eagle_run = {
        "command": "python3 scripts/train_embedded.py --models eagle --out /o", "device": "GPU", "date": "today",
        "versions": {"torch": "x"}, "seed": 0, "compile": True, "data_files_sha256": base["data_files_sha256"],
        "corpus": {"files": 1}, "metrics": {"embedded": {"eagle": {"next_next_top1": 0.6}}, "total_wall_time_s": 9.0},
        "phases": {"eagle": {"steps": 7}},
    }
    merged = run.merge_eagle_record(base, eagle_run)
    assert json.dumps(base) == original, "the base record is not modified in place"
    entry = merged["metrics"]["embedded"].pop("eagle")
    base["metrics"]["embedded"].pop("eagle")
    assert merged["metrics"] == base["metrics"] and merged["command"] == base["command"]
    assert merged["phases"]["eagle"] == {"steps": 7} and merged["phases"]["embedded"] == base["phases"]["embedded"]
    assert entry["next_next_top1"] == 0.6
    assert entry["run"]["command"] == eagle_run["command"] and entry["run"]["date"] == "today"
    assert entry["run"]["same_data_as_base"] and entry["run"]["total_wall_time_s"] == 9.0
