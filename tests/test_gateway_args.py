"""Gateway mode without processes: flag validation, core slices per replica, the smg command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenspeed.api.args import ListenOptions
from tokenspeed.api.settings import ServerSettings
from tokenspeed.cli import build_parser
from tokenspeed.gateway.launcher import smg_command
from tokenspeed.gateway.processes import cpu_slices


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-size", "2"], "needs a gateway"),
        (["--data-parallel-size", "0", "--gateway", "smg"], "at least 1"),
        (["--gateway", "smg", "--grpc-port", "5000"], "give one of them"),
        (["--grpc-port", "70000"], "not a port number"),
    ],
)
def test_bad_flag_combinations_are_refused(argv, message, capsys):
    from tokenspeed.api.args import serve_config

    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    with pytest.raises(SystemExit):
        serve_config(args, args.serve_parser)
    assert message in capsys.readouterr().err


def test_cpu_slices_are_disjoint_and_cover_the_cores():
    assert cpu_slices([0, 1], 2) == [[0], [1]]
    assert cpu_slices([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert cpu_slices([0, 1], 3) == [[0], [1], [0]]  # fewer cores than replicas: shared


def test_smg_command_routes_by_cache_over_every_replica():
    settings = ServerSettings(served_model_names=["m"], tool_call_parser="hermes", reasoning_parser="qwen3")
    listen = ListenOptions("127.0.0.1", 8000, "info", True, None)
    command = smg_command(settings, listen, replica_ports=[5001, 5002], tokenizer_folder=Path("/models/m"),
                          page_size=16, chat_template_file=None, log_level="warning")
    joined = " ".join(command)
    assert "--worker-urls grpc://127.0.0.1:5001 grpc://127.0.0.1:5002" in joined
    assert "--policy cache_aware" in joined and "--block-size 16" in joined
    assert "--tool-call-parser qwen" in joined and "--reasoning-parser qwen3" in joined
    assert "--api-key" not in joined  # the key travels in the environment, never on a command line
