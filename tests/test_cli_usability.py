"""What a newcomer meets on the command line: help on every option with its default, one-line errors."""

from __future__ import annotations

import argparse
import subprocess
import sys

from tokenspeed.cli import build_parser
from tokenspeed.models.embedded.materialize import has_trained_weights


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
