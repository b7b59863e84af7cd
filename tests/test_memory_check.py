"""The engine refuses, before allocating, a model that cannot fit (issue 19, item 1).

The free-memory probe is mocked: an 8B preset's refusal must not depend on the
machine the tests run on (tests/test_cli_usability.py has the real one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.checkpoints import _COMMON, _DEEPSEEK_COMMON, DEEPSEEK_FAMILIES, FAMILIES
from tokenspeed import LLM
from tokenspeed.errors import NotEnoughMemory
from tokenspeed.executor import executor as executor_module
from tokenspeed.executor import memory_check
from tokenspeed.models import ModelConfig, build_model
from tokenspeed.models.embedded.materialize import package_config


def _config(family: str) -> ModelConfig:
    if family == "embedded-moe":  # DeepSeek-V3 shaped, with an MTP layer
        return ModelConfig.from_dict(package_config(family))
    spec = {**_DEEPSEEK_COMMON, **DEEPSEEK_FAMILIES[family]} if family in DEEPSEEK_FAMILIES \
        else {**_COMMON, **FAMILIES[family]}
    return ModelConfig.from_dict(getattr(transformers, spec.pop("config"))(**spec).to_dict())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "deepseek_v3",
                                    "embedded-moe"])
def test_weight_estimate_is_what_the_model_holds(family):
    config = _config(family)
    model = build_model(config, dtype=torch.float32, device=torch.device("cpu"))
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert memory_check.weight_bytes(config, torch.float32) == sum(storages.values())
    assert memory_check.weight_bytes(config, torch.bfloat16) * 2 == sum(storages.values())


@pytest.fixture
def nothing_allocated(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were allocated before the memory check")

    monkeypatch.setattr(executor_module, "load_model", refuse)
    monkeypatch.delenv("TOKENSPEED_SKIP_MEMORY_CHECK", raising=False)


def test_an_8b_preset_is_refused_with_the_numbers_before_allocating(monkeypatch, nothing_allocated):
    monkeypatch.setattr(memory_check, "free_memory_bytes", lambda device: 14_200_000_000)
    with pytest.raises(NotEnoughMemory) as error:
        LLM("preset:qwen3-8b", dtype="bfloat16", max_model_len=4096, show_progress=False)
    message = str(error.value)
    assert message.startswith("not enough memory on cpu: needs ~16.4 GB for weights + ")
    assert "14.2 GB free" in message and "TOKENSPEED_SKIP_MEMORY_CHECK" in message


def test_the_kv_pool_counts_too(monkeypatch, nothing_allocated):
    """Weights that fit beside a KV pool that does not are refused as well."""
    config = _config("qwen3")
    weights = memory_check.weight_bytes(config, torch.float32)
    monkeypatch.setattr(memory_check, "free_memory_bytes", lambda device: weights + 1000)
    with pytest.raises(NotEnoughMemory, match="for the KV cache"):
        memory_check.check_fits(weights=weights, kv_cache=2000, kv_what="the KV cache", device=torch.device("cpu"),
                                dtype=torch.float32, gpu_memory_utilization=0.9)
    memory_check.check_fits(weights=weights, kv_cache=1000, kv_what="the KV cache", device=torch.device("cpu"),
                            dtype=torch.float32, gpu_memory_utilization=0.9)


def test_the_embedded_model_builds_when_memory_suffices_and_the_switch_skips_the_check(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_SKIP_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(memory_check, "free_memory_bytes", lambda device: 1)
    with pytest.raises(NotEnoughMemory, match=r"float32\)"):  # fp32 on the CPU: the message offers bf16
        LLM(max_model_len=512, show_progress=False)
    monkeypatch.setenv("TOKENSPEED_SKIP_MEMORY_CHECK", "1")
    with LLM(max_model_len=512, show_progress=False) as llm:
        assert llm.generate("def f():")[0].outputs[0].token_ids


def test_on_a_gpu_the_allocator_cache_is_free_and_the_share_kept_back_is_not(monkeypatch):
    """17 GB free on the device + 3 GB cached by the allocator = 20 GB; at 0.9 of 141 GB, 5.9 GB of it
    may hold the engine when that share sizes the KV pool, all 20 GB when the pool's size is given."""
    monkeypatch.delenv("TOKENSPEED_SKIP_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (17_000_000_000, 141_000_000_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5_000_000_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2_000_000_000)
    need = dict(weights=16_400_000_000, kv_cache=500_000_000, kv_what="the KV cache",
                device=torch.device("cuda", 0), dtype=torch.bfloat16)
    with pytest.raises(NotEnoughMemory) as error:
        memory_check.check_fits(**need, gpu_memory_utilization=0.9)
    message = str(error.value)
    assert "needs ~16.4 GB for weights + 0.5 GB for the KV cache, 20.0 GB free (5.9 GB of it within " \
           "--gpu-memory-utilization 0.9)" in message and "--dtype" not in message
    memory_check.check_fits(**need, gpu_memory_utilization=None)


def test_the_cpu_probe_reads_this_machine():
    free = memory_check.free_memory_bytes(torch.device("cpu"))
    if free is None:
        pytest.skip("no /proc/meminfo here")
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < free <= total
