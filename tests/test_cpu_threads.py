"""CPU thread count, chosen at engine start in every front end: explicit, or sized to the cores and the model."""

from __future__ import annotations

import os

import pytest
import torch

from tokenspeed.cli import build_parser
from tokenspeed.config import EngineConfig, default_cpu_threads
from tokenspeed.engine.core import EngineCore
from tokenspeed.engine_args import engine_config_from_args
from tokenspeed.errors import InvalidRequest
from tokenspeed.executor.cpu_threads import PARAMS_PER_THREAD, auto_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_leaves_one_core_for_the_api_process():
    usable = len(os.sched_getaffinity(0))
    assert default_cpu_threads() == max(1, usable - 1)


def test_engine_applies_explicit_or_model_sized_cpu_threads(restore_threads):
    torch.set_num_threads(2)
    # The embedded model (a few million weights) keeps one thread busy, whatever torch had.
    EngineCore(EngineConfig(device="cpu", num_kv_pages=64, max_model_len=256))
    assert torch.get_num_threads() == 1
    EngineCore(EngineConfig(device="cpu", num_kv_pages=64, max_model_len=256, cpu_threads=2))
    assert torch.get_num_threads() == 2


def test_in_process_front_ends_choose_threads(restore_threads):
    from tokenspeed import LLM

    torch.set_num_threads(2)
    llm = LLM(num_kv_pages=64, max_model_len=256, show_progress=False)
    try:
        assert torch.get_num_threads() == 1
    finally:
        llm.shutdown()


def test_auto_threads_by_cores_model_size_and_api_process():
    assert auto_cpu_threads(4_000_000, api_process=False, cores=16) == 1  # a tiny model: one thread
    assert auto_cpu_threads(8 * 10**9, api_process=False, cores=16) == 16
    assert auto_cpu_threads(8 * 10**9, api_process=True, cores=16) == 15  # a core left to the API process
    assert auto_cpu_threads(8 * 10**9, api_process=True, cores=1) == 1
    assert auto_cpu_threads(3 * PARAMS_PER_THREAD, api_process=False, cores=16) == 3


def test_flag_and_validation():
    args = build_parser().parse_args(["generate", "x", "--cpu-threads", "3"])
    assert engine_config_from_args(args).cpu_threads == 3
    with pytest.raises(InvalidRequest, match="cpu_threads"):
        EngineConfig(cpu_threads=0).validate()
