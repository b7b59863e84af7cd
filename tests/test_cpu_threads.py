"""CPU thread count: the server's engine process leaves a core to the API process; LLM keeps torch's default."""

from __future__ import annotations

import os

import pytest
import torch

from tokenspeed.cli import build_parser
from tokenspeed.config import EngineConfig, default_cpu_threads
from tokenspeed.engine.core import EngineCore
from tokenspeed.engine_args import engine_config_from_args
from tokenspeed.errors import InvalidRequest


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_leaves_one_core_for_the_api_process():
    usable = len(os.sched_getaffinity(0))
    assert default_cpu_threads() == max(1, usable - 1)


def test_engine_applies_cpu_threads_only_when_set(restore_threads):
    torch.set_num_threads(2)
    EngineCore(EngineConfig(device="cpu", num_kv_pages=64, max_model_len=256))
    assert torch.get_num_threads() == 2
    EngineCore(EngineConfig(device="cpu", num_kv_pages=64, max_model_len=256, cpu_threads=1))
    assert torch.get_num_threads() == 1


def test_flag_and_validation():
    args = build_parser().parse_args(["generate", "x", "--cpu-threads", "3"])
    assert engine_config_from_args(args).cpu_threads == 3
    with pytest.raises(InvalidRequest, match="cpu_threads"):
        EngineConfig(cpu_threads=0).validate()
