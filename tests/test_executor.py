"""The executor interface: the real `Executor` and the `SimulatedExecutor` both serve `EngineCore`."""

from __future__ import annotations

import pytest
import torch

from tokenspeed.config import EngineConfig
from tokenspeed.engine.core import EngineCore
from tokenspeed.errors import InvalidRequest
from tokenspeed.executor.executor import Executor, load_model
from tokenspeed.executor.interface import ModelExecutor
from tokenspeed.kernels import KernelSelectionError, clear_kernel_overrides
from tokenspeed.models import ModelConfig
from tokenspeed.scheduler import SamplingParams, Scheduler, SchedulerConfig
from tokenspeed.scheduler.simulated_executor import SimulatedExecutor


def test_executor_reports_its_limits_and_builds_with_the_plain_loader(checkpoints):
    folder = checkpoints["llama"]
    config = EngineConfig(model=str(folder), num_kv_pages=40, max_model_len=128, page_size=8, enforce_eager=True)
    executor = Executor(config, folder)
    assert isinstance(executor, ModelExecutor)
    limits = executor.limits
    assert (limits.num_pages, limits.page_size, limits.max_model_len) == (40, 8, 128)
    assert limits.vocab_size == executor.model_config.vocab_size and limits.device == "cpu"
    assert executor.kv.num_pages == 41  # one scratch page for padded CUDA-graph rows
    # What a tensor-parallel worker would call: the same weights from the same checkpoint.
    again = load_model(
        ModelConfig.from_pretrained(folder), folder, load_format="auto", dtype=executor.dtype, device=executor.device
    )
    theirs = dict(again.named_parameters())
    for name, param in executor.model.named_parameters():
        assert torch.equal(param, theirs[name]), name


def test_executor_refuses_a_pool_smaller_than_one_request(checkpoints):
    folder = checkpoints["llama"]
    with pytest.raises(InvalidRequest, match="cannot hold one request"):
        Executor(EngineConfig(model=str(folder), num_kv_pages=3, max_model_len=128, page_size=8), folder)


def test_a_dead_kernel_override_stops_the_engine_at_start(checkpoints):
    config = EngineConfig(model=str(checkpoints["llama"]), kernel_overrides=("attention.paged=reference",))
    try:
        with pytest.raises(KernelSelectionError, match="known modes: decode, extend"):
            EngineCore(config)
    finally:
        clear_kernel_overrides()


def _tokens_on_simulated_executor(overlap: bool) -> dict[str, list[int]]:
    cores: list[EngineCore] = []  # the KV is checked against the core's own requests
    simulated = SimulatedExecutor(24, 4, 50, history=lambda request_id: cores[0].scheduler.token_history(request_id))
    core = EngineCore(EngineConfig(max_num_seqs=3, max_num_batched_tokens=16, disable_overlap=not overlap),
                      executor=simulated)
    cores.append(core)
    assert isinstance(simulated, ModelExecutor) and core.limits.max_model_len == 96
    prompts = {f"r{i}": [1, 2, 3, 4, 5, 6, 7, 8][: 3 + i] + [10 + i] * i for i in range(5)}
    for request_id, prompt in prompts.items():
        params = SamplingParams(temperature=1.0, seed=int(request_id[1:]), max_tokens=9, min_tokens=2)
        core.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    while core.has_unfinished():
        for update in core.step():
            tokens[update.request_id] += update.new_token_ids
    return tokens


def test_engine_core_runs_on_the_simulated_executor_with_and_without_overlap():
    synchronous = _tokens_on_simulated_executor(overlap=False)
    assert all(len(t) == 9 for t in synchronous.values())
    assert _tokens_on_simulated_executor(overlap=True) == synchronous


def test_rows_carry_token_history_only_where_the_executor_reads_it():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
                                          page_size=4, num_pages=32))
    scheduler.submit("plain", [1, 2, 3], SamplingParams(temperature=0.0))
    scheduler.submit("logprobs", [1, 2, 4], SamplingParams(temperature=0.0, logprobs=2))
    scheduler.submit("penalty", [1, 2, 5], SamplingParams(temperature=0.0, repetition_penalty=1.2))
    scheduler.submit("prompt_logprobs", [1, 2, 6], SamplingParams(temperature=0.0, prompt_logprobs=1))
    rows = {row.request_id: row for row in scheduler.next_plan().rows}
    for request_id in ("plain", "logprobs"):
        assert rows[request_id].prompt_token_ids is None and rows[request_id].output_token_ids is None
    for request_id in ("penalty", "prompt_logprobs"):
        request = scheduler.get(request_id)
        assert request is not None
        assert rows[request_id].prompt_token_ids is request.prompt_token_ids  # a reference, not a copy
        assert rows[request_id].output_token_ids is request.output_token_ids
