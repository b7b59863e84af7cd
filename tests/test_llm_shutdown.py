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


def _gpu_engine() -> LLM:
    """An 8B model (the preset, random weights) whose KV pool takes what 0.9 of the device leaves."""
    return LLM("preset:llama-3.1-8b", skip_tokenizer_init=True, max_model_len=4096, cuda_graph_max_bs=32,
               show_progress=False)


@pytest.mark.gpu
def test_gpu_memory_returns_to_where_it_started():
    """Shutdown, leaving a `with` block and `del` each give the device back: three such engines
    are built one after another in this process (the second could not fit beside the first), the
    allocator returns to where it started after each, and each gets the same KV pool (to within the
    slack). The slack is for the cuBLAS workspaces torch keeps per stream."""
    slack = 256 << 20
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    reserved, free = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
    pools: list[int] = []
    page_bytes: list[int] = []

    def use(llm: LLM) -> None:
        assert llm.core.executor.cuda_graphs_enabled
        outputs = llm.generate([PROMPT] * 4, PARAMS)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [8] * 4
        pools.append(llm.core.limits.num_pages)
        page_bytes.append(llm.core.executor._bytes_per_page())
        assert torch.cuda.memory_reserved() > reserved + (50 << 30)  # weights + a pool filling the device

    def returned() -> None:
        assert torch.cuda.memory_reserved() <= reserved + slack
        assert torch.cuda.mem_get_info()[0] >= free - slack

    llm = _gpu_engine()
    use(llm)
    llm.shutdown()
    returned()
    with _gpu_engine() as llm:
        use(llm)
    returned()
    llm = _gpu_engine()
    use(llm)
    del llm
    returned()
    # each pool fills what is free at its start: equal but for what stays within the slack
    assert max(pools) - min(pools) <= slack // page_bytes[0]
