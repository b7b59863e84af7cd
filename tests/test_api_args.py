"""`tokenspeed serve` flags: grouped help, MODEL positional vs --model, settings built from flags."""

from __future__ import annotations

import pytest

from tokenspeed.api.args import serve_config
from tokenspeed.cli import build_parser


def parse(*argv: str):
    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    return serve_config(args, args.serve_parser)


def test_help_is_grouped_and_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for group in ("server:", "chat templating and output parsing:", "engine:"):
        assert group in text
    for flag in ("--host", "--port", "--served-model-name", "--api-key", "--max-waiting-requests",
                 "--tool-call-parser", "--reasoning-parser", "--chat-template", "--dtype", "--device",
                 "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--page-size",
                 "--disable-prefix-cache", "--tokenizer-cache-tokens", "--drain-timeout"):
        assert flag in text


def test_defaults_serve_the_embedded_model_on_loopback():
    config, settings, listen = parse()
    assert config.model is None and settings.served_model_names == ["embedded"]
    assert (listen.host, listen.port, settings.api_key) == ("127.0.0.1", 8000, None)


def test_positional_model_and_flags(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    config, settings, listen = parse(
        "some/model", "--served-model-name", "a", "b", "--api-key", "k", "--tool-call-parser", "qwen",
        "--reasoning-parser", "deepseek_r1", "--chat-template", str(template), "--max-waiting-requests", "3",
        "--max-model-len", "512", "--disable-prefix-cache", "--port", "9001",
    )
    assert config.model == "some/model" and config.max_model_len == 512 and not config.enable_prefix_caching
    assert settings.served_model_names == ["a", "b"] and settings.model_name == "a"
    assert (settings.api_key, settings.tool_call_parser, settings.reasoning_parser) == ("k", "qwen", "deepseek_r1")
    assert settings.chat_template == "{{ messages[0].content }}"
    assert (listen.port, listen.max_waiting_requests) == (9001, 3)
    assert parse("--drain-timeout", "0.5")[2].drain_timeout_s == 0.5 and listen.drain_timeout_s == 4.0
    assert parse("--model", "x/y")[1].served_model_names == ["x/y"]
    assert parse("--tokenizer-cache-tokens", "0")[1].tokenizer_cache_tokens == 0
    assert parse()[1].tokenizer_cache_tokens > 0  # on by default


@pytest.mark.parametrize(
    "argv",
    [("m1", "--model", "m2"), ("--max-waiting-requests", "0"), ("--tool-call-parser", "nope"),
     ("--tokenizer-cache-tokens", "-1"), ("--drain-timeout", "-1")],
)
def test_contradictory_or_invalid_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2 and "error" in capsys.readouterr().err
