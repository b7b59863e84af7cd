"""The speed features' off switches and `--kernel` reach the engine."""

from __future__ import annotations

import argparse

import pytest
import torch

from tokenspeed.config import EngineConfig, parse_kernel_override
from tokenspeed.engine.core import EngineCore
from tokenspeed.engine_args import add_engine_args, engine_config_from_args
from tokenspeed.errors import InvalidRequest
from tokenspeed.kernels import clear_kernel_overrides, select_kernel, set_kernel_override


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_flags_map_to_config():
    config = parse("--enforce-eager", "--disable-overlap", "--kernel", "attention.decode=reference",
                   "--kernel", "norm.rms=reference", "--cuda-graph-max-bs", "32")
    assert config.enforce_eager and config.disable_overlap and config.cuda_graph_max_bs == 32
    assert config.kernel_overrides == ("attention.decode=reference", "norm.rms=reference")
    defaults = parse()
    assert not defaults.enforce_eager and not defaults.disable_overlap and defaults.kernel_overrides == ()


def test_kernel_override_syntax():
    assert parse_kernel_override(" attention.decode = triton ") == ("attention", "decode", "triton")
    for bad in ("attention=triton", "attention.decode", ".decode=x", "attention.decode="):
        with pytest.raises(InvalidRequest):
            parse_kernel_override(bad)
    with pytest.raises(InvalidRequest):
        EngineConfig(kernel_overrides=("nonsense",)).validate()


def test_engine_applies_kernel_overrides_and_switches():
    core = EngineCore(EngineConfig(kernel_overrides=("norm.rms=reference",), disable_overlap=True,
                                   num_kv_pages=64, max_model_len=256))
    assert not core.overlap and not core.executor.cuda_graphs_enabled
    assert core.executor.model.model.norm._kernel.__name__ == "rms_norm_reference"
    # The overrides were this engine's: the next one built in the process picks its kernels afresh.
    assert select_kernel("norm", "rms", platform="cpu", dtype=torch.float32).name != "reference"
    core.shutdown()


def test_an_engines_overrides_leave_the_ones_set_before_in_place():
    set_kernel_override("attention", "decode", "reference")
    try:
        EngineCore(EngineConfig(kernel_overrides=("norm.rms=reference",), num_kv_pages=64, max_model_len=256)).shutdown()
        assert select_kernel("attention", "decode", platform="cpu", dtype=torch.float32).name == "reference"
        assert select_kernel("norm", "rms", platform="cpu", dtype=torch.float32).name != "reference"
    finally:
        clear_kernel_overrides()
