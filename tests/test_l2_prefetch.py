"""`kernels/l2_prefetch.py`: the byte budget's split, a no-op off CUDA, and on a GPU the same tokens on and off.

The prefetch changes no value anywhere (nothing is written), so on the GPU
the engine's greedy tokens with it on must equal those with it off, through
the fused decode forms in CUDA graphs, with FP8 and bf16 weights, PDL on and
off; and the kernel must capture into a graph and replay.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tokenspeed.kernels.l2_prefetch import (
    BULK_BYTES,
    LINE_BYTES,
    l2_prefetch,
    prefetch_fraction,
    units_within,
)


def test_budget_goes_to_the_first_tensor_then_the_second() -> None:
    assert units_within([10 * LINE_BYTES, 10 * LINE_BYTES], 15 * LINE_BYTES) == [10, 5]
    assert units_within([10 * LINE_BYTES, 10 * LINE_BYTES], 4 * LINE_BYTES + 7) == [4, 0]
    assert units_within([3 * LINE_BYTES + 5, 10 * LINE_BYTES], 100 * LINE_BYTES) == [3, 10]
    assert units_within([10 * LINE_BYTES], 0) == [0]
    assert units_within([3 * BULK_BYTES - 1, BULK_BYTES], 100 * BULK_BYTES, BULK_BYTES) == [2, 1]


def test_off_by_default_and_a_no_op_off_cuda(monkeypatch) -> None:
    monkeypatch.delenv("TOKENSPEED_L2_PREFETCH", raising=False)
    assert prefetch_fraction() == 0.0
    monkeypatch.setenv("TOKENSPEED_L2_PREFETCH", "0.5")
    weight = torch.randn(64, 64)
    before = weight.clone()
    l2_prefetch([weight, weight])  # CPU: nothing to warm, nothing launched
    assert torch.equal(weight, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bulk", ["0", "1"])
def test_prefetch_captures_in_a_graph_and_changes_nothing(monkeypatch, bulk) -> None:
    monkeypatch.setenv("TOKENSPEED_L2_PREFETCH", "0.9")
    monkeypatch.setenv("TOKENSPEED_L2_PREFETCH_BULK", bulk)
    a = torch.randint(-100, 100, (4096, 4096), dtype=torch.int8, device="cuda").view(torch.float8_e4m3fn)
    b = torch.randn(3, 1000, dtype=torch.bfloat16, device="cuda")  # not a whole number of lines
    x = torch.randn(1024, device="cuda")
    copies = a.clone(), b.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        l2_prefetch([a, b])  # compiles outside the capture
        y = x * 2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch([a, b])
        y = x * 2
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)
    assert torch.equal(a.view(torch.int8), copies[0].view(torch.int8)) and torch.equal(b, copies[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("quantization", ["fp8", None])
def test_engine_tokens_identical_with_prefetch_on_and_off(tmp_path, monkeypatch, quantization, pdl) -> None:
    from tests.checkpoints import make_checkpoint, prompts
    from tokenspeed import LLM, SamplingParams

    folder = make_checkpoint(
        "llama", tmp_path, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, initializer_range=0.05,
    )  # fmt: skip
    prompt = [t % 4096 for t in prompts(1, seed=4, min_len=60, max_len=61)[0]]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    monkeypatch.setenv("TOKENSPEED_PDL", pdl)
    tokens = {}
    for fraction in ("0.5", "0"):
        monkeypatch.setenv("TOKENSPEED_L2_PREFETCH", fraction)
        llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cuda", num_kv_pages=512,
                  max_model_len=512, max_num_seqs=8, show_progress=False, quantization=quantization)
        assert llm.core.executor.cuda_graphs_enabled
        tokens[fraction] = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens["0.5"] == tokens["0"]
