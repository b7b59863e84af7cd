"""What a newcomer meets on the command line: help on every option with its default, one-line errors."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tokenspeed.cli import build_parser
from tokenspeed.engine.model_files import load_tokenizer
from tokenspeed.executor.memory_check import free_memory_bytes, weight_bytes
from tokenspeed.models.embedded.materialize import embedded_model_path, has_trained_weights
from tokenspeed.models.presets import load_preset


def _parsers(parser: argparse.ArgumentParser, path: str = "tokenspeed"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_option_has_help_with_its_default():
    missing = []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            name = f"{path} {'/'.join(action.option_strings) or action.dest}"
            text = action.help or ""
            if not text.strip():
                missing.append(f"{name}: no help")
                continue
            shows_default = "default" in text or "%(default)" in text
            has_default = action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS)
            if has_default and not shows_default and action.choices is None:
                missing.append(f"{name}: default {action.default!r} not shown")
    assert not missing, "\n".join(missing)


def test_model_help_mentions_presets():
    generate = dict(_parsers(build_parser()))["tokenspeed generate"]
    (model,) = [a for a in generate._actions if "--model" in a.option_strings]
    assert "preset" in model.help


def test_bad_log_level_is_a_one_line_usage_error():
    done = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "--log-level", "foo", "env"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "invalid choice" in done.stderr


def test_kernels_for_an_unknown_platform_fail():
    done = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "kernels", "--platform", "tpu"],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "no registered kernel serves" in done.stderr


def test_serve_with_an_unsupported_architecture_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPTFooForCausalLM"], "model_type": "foo"}')
    done = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "serve", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "ERROR" not in done.stderr, done.stderr
    assert "error: unsupported architecture GPTFooForCausalLM" in done.stderr
    assert "You are using a model of type" not in done.stderr, done.stderr  # transformers' tokenizer noise


def test_no_tokenizer_length_warning_before_our_own_check():
    done = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "generate", "x " * 5000, "--max-model-len", "512"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "max_model_len is 512" in done.stderr
    assert "Token indices sequence length" not in done.stderr, done.stderr


def test_cli_max_tokens_beyond_the_context_is_refused_with_the_numbers():
    done = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "generate", "x", "--max-tokens", "5000",
                           "--max-model-len", "512"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "max_tokens=5000" in done.stderr and "max_model_len is 512" in done.stderr
    # The embedded model's notice, given only while its trained weights are not in the checkout.
    assert ("random weights" in done.stderr) == (not has_trained_weights("embedded"))


def test_a_real_model_name_is_not_taken_for_a_preset():
    done = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "generate", "x", "--model", "Qwen3-8B"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "random weights" in done.stderr and "preset:llama-3.1-8b" in done.stderr  # the presets, listed
    assert "use --model preset:qwen3-8b" in done.stderr
    assert "is a preset" not in done.stderr  # no preset was built


def test_a_model_too_large_for_this_machine_is_refused_not_killed():
    """The 8B preset in fp32 needs ~32 GB: a smaller machine gets a message, not the kernel's OOM kill."""
    needs = weight_bytes(load_preset("llama-3.1-8b"), torch.float32)
    free = free_memory_bytes(torch.device("cpu"))
    if free is None or free > needs:
        pytest.skip(f"this machine has {free} bytes free, enough to load the 8B preset")
    done = subprocess.run([sys.executable, "-m", "tokenspeed.cli", "generate", "x", "--model", "preset:llama-3.1-8b",
                           "--max-model-len", "1024"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "preset:llama-3.1-8b is a preset: the model's shape with random weights" in done.stderr
    assert "error: not enough memory on cpu: needs ~32.1 GB for weights + " in done.stderr


def test_tokenizer_of_a_model_type_transformers_does_not_know_loads_quietly(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_path() / name, tmp_path / name)
    (tmp_path / "config.json").write_text('{"architectures": ["GPTFooForCausalLM"], "model_type": "foo"}')
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    config_logger = logging.getLogger("transformers.configuration_utils")
    config_logger.addHandler(handler)
    try:
        assert load_tokenizer(tmp_path).encode("def f():")
    finally:
        config_logger.removeHandler(handler)
    assert not [r for r in records if "You are using a model of type" in r.getMessage()]
