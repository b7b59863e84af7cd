"""The shipped embedded models: names resolve, folders have the promised layout, and (once trained) they write Python."""

from __future__ import annotations

import ast
import logging

import pytest
from safetensors import safe_open

from tokenspeed import LLM, SamplingParams
from tokenspeed.engine.model_files import is_preset, resolve_model_folder
from tokenspeed.models.embedded import materialize
from tokenspeed.models.embedded.materialize import (
    EAGLE_DIR,
    embedded_eagle_path,
    embedded_model_path,
    has_trained_weights,
    package_config,
)

COMPLETION_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef "]


def test_embedded_moe_resolves_and_runs_with_its_mtp_layer():
    assert not is_preset("embedded-moe")
    folder = resolve_model_folder("embedded-moe")
    assert folder == embedded_model_path("embedded-moe") != embedded_model_path("embedded")
    config = package_config("embedded-moe")
    mtp = f"model.layers.{config['num_hidden_layers']}"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    for leaf in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                 "shared_head.norm.weight", "shared_head.head.weight"):
        assert f"{mtp}.{leaf}" in names, leaf  # DeepSeek's MTP layout, copies included
    llm = LLM("embedded-moe", max_model_len=256, show_progress=False)
    assert llm.core.executor.model_config.architecture == "DeepseekV3ForCausalLM" and llm.core.executor.model_config.moe is not None
    assert len(llm.core.executor.model.model.layers) == config["num_hidden_layers"] + 1  # MTP kept
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6


def test_default_model_folder_carries_the_eagle_head():
    head = embedded_eagle_path()
    assert head.parent == embedded_model_path() and head.name == EAGLE_DIR
    with safe_open(str(head / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "fc.bias"} <= names and not any("embed_tokens" in n for n in names)
    assert materialize.package_config("embedded", draft=True)["num_hidden_layers"] == 1


def test_untrained_package_says_so(caplog, monkeypatch):
    monkeypatch.setattr(materialize, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="tokenspeed.models"):
        embedded_model_path("embedded-moe")
    noticed = any("no trained weights" in r.getMessage() for r in caplog.records)
    assert noticed == (not has_trained_weights("embedded-moe"))


def _first_statement_parses(prompt: str, completion: str) -> bool:
    """Some prefix of the text, reaching at least one line past the prompt, is valid Python."""
    lines = (prompt + completion).split("\n")
    first = prompt.count("\n") + 2
    for end in range(first, len(lines) + 1):
        try:
            ast.parse("\n".join(lines[:end]))
        except SyntaxError:
            continue
        return True
    return False


@pytest.mark.skipif(not has_trained_weights("embedded"),
                    reason="no trained weights committed yet (issue 14: scripts/train_embedded.py on the H200)")
def test_trained_default_model_completes_python():
    llm = LLM(max_model_len=512, show_progress=False)
    outputs = llm.generate(COMPLETION_PROMPTS, SamplingParams(temperature=0.0, max_tokens=96))
    parsed = [_first_statement_parses(p, o.outputs[0].text) for p, o in zip(COMPLETION_PROMPTS, outputs)]
    assert sum(parsed) >= 2, [(p, o.outputs[0].text) for p, o in zip(COMPLETION_PROMPTS, outputs)]


def test_first_statement_check_tells_code_from_noise():
    assert _first_statement_parses("def fibonacci(n):", "\n    if n < 2:\n        return n\n    return fib")
    assert _first_statement_parses("class Stack:", "\n    def __init__(self):\n        self.items = []\n")
    assert not _first_statement_parses("def fibonacci(n):", "):):):):")
    assert not _first_statement_parses("import os\n\ndef ", "(((")
