"""`LLM.shutdown()`, `with LLM(...)` and `del llm` give the device back (issue 19, item 8).

The Executor owns the weights, the KV pool and the CUDA graphs; shutting the
engine down must leave nothing of them referenced, so a second engine can be
built in the same process. On the CPU this is shown with weak references (no
tensor survives); on a GPU by the allocator's own count returning to where it
started.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tokenspeed import LLM, SamplingParams
from tokenspeed.errors import EngineDead

PROMPT = {"prompt_token_ids": [11, 12, 13, 14, 15]}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _device_state(llm: LLM) -> list[weakref.ref]:
    """Weak references to what the executor holds: the model, every weight, every KV tensor."""
    executor = llm.core.executor
    tensors = [*executor.model.parameters(), *executor.kv.k, *executor.kv.v]
    return [weakref.ref(executor.model), weakref.ref(executor.runner), *map(weakref.ref, tensors)]


def _alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_shutdown_frees_weights_and_kv_and_a_second_llm_builds():
    llm = LLM(max_model_len=256, show_progress=False)
    first = llm.generate(PROMPT, PARAMS)[0].outputs[0].token_ids
    refs = _device_state(llm)
    llm.shutdown()
    assert _alive(refs) == 0
    with pytest.raises(EngineDead, match="shut down"):
        llm.generate(PROMPT, PARAMS)
    llm.shutdown()  # a second call does nothing
    second = LLM(max_model_len=256, show_progress=False)
    assert second.generate(PROMPT, PARAMS)[0].outputs[0].token_ids == first
    second.shutdown()


def test_leaving_a_with_block_frees_the_engine():
    with LLM(max_model_len=256, show_progress=False) as llm:
        assert len(llm.generate(PROMPT, PARAMS)[0].outputs[0].token_ids) == 8
        refs = _device_state(llm)
    assert _alive(refs) == 0


def test_dropping_the_last_reference_frees_the_engine():
    llm = LLM(max_model_len=256, show_progress=False)
    llm.generate(PROMPT, PARAMS)
    refs = _device_state(llm)
    del llm
    assert _alive(refs) == 0


@pytest.mark.gpu
def test_gpu_memory_returns_to_where_it_started():
    """CUDA graphs on, 0.9 of the device for the KV pool: after shutdown the allocator holds what it
    held before (64 MiB of slack for cuBLAS/Triton workspaces), so a second LLM gets the same pool."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    slack = 64 << 20
    pools = []
    for _ in range(2):
        llm = LLM(max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.9, show_progress=False)
        assert llm.core.executor.cuda_graphs_enabled
        assert len(llm.generate([PROMPT] * 3, PARAMS)[0].outputs[0].token_ids) == 8
        pools.append(llm.core.limits.num_pages)
        assert torch.cuda.memory_reserved() > reserved + (1 << 30)  # the pool took the device
        llm.shutdown()
        assert torch.cuda.memory_allocated() <= allocated + slack
        assert torch.cuda.memory_reserved() <= reserved + slack
    assert pools[0] == pools[1]
