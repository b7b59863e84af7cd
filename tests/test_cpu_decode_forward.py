"""The CPU decode forward (`executor/cpu_decode.py`) equals the model's eager layers bit for bit, and the
engine's greedy tokens are the same with it on and off (`disable_cpu_decode_forward`)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import prompts
from tokenspeed import LLM, SamplingParams
from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.batch_builder import RowSpec, build_forward_batch
from tokenspeed.executor.cpu_decode import CPUDecodeForward
from tokenspeed.kernels import scoped_kernel_overrides
from tokenspeed.models import ModelConfig, build_model, load_weights

PAGE_SIZE = 16


def _model(folder):
    config = ModelConfig.from_pretrained(folder)
    model = build_model(config, dtype=torch.float32, device=torch.device("cpu"))
    load_weights(model, folder, load_format="auto")
    return model.eval(), config


def _kv(config: ModelConfig, num_pages: int, seed: int) -> PagedKVStorage:
    kv = PagedKVStorage(num_layers=config.num_layers, num_pages=num_pages, page_size=PAGE_SIZE,
                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    for cache in (*kv.k, *kv.v):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return kv


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("lengths", [[1], [37], [16, 5, 70, 33]])
def test_decode_forward_equals_layers_bitwise(checkpoints, family: str, lengths: list[int]) -> None:
    """Hidden states and every layer's written K/V are equal to the eager layers', bit for bit (random K/V
    history in scattered pages; lengths on and off page boundaries)."""
    model, config = _model(checkpoints[family])
    num_pages = sum(-(-n // PAGE_SIZE) for n in lengths) + 3
    pool = list(range(num_pages))
    random.Random(len(lengths)).shuffle(pool)
    rows, used = [], 0
    rng = random.Random(5)
    for n in lengths:
        pages = pool[used : used + -(-n // PAGE_SIZE)]
        used += len(pages)
        rows.append(RowSpec([rng.randrange(config.vocab_size)], n - 1, pages))
    batch = build_forward_batch(rows, PAGE_SIZE, logits_indices=range(len(rows)))
    eager_kv, fast_kv = _kv(config, num_pages, 1), _kv(config, num_pages, 1)
    fast = CPUDecodeForward.build(model, fast_kv)
    assert fast is not None
    with torch.inference_mode():
        expected = model(batch, eager_kv)
        got = fast.run(batch)
    assert torch.equal(got, expected)
    for a, b in zip((*eager_kv.k, *eager_kv.v), (*fast_kv.k, *fast_kv.v)):
        assert torch.equal(a, b)


def test_not_built_where_its_kernels_do_not_run(checkpoints) -> None:
    """A kernel override (or biases: qwen2) keeps every step on the model's layers."""
    folder = checkpoints["llama"]
    with scoped_kernel_overrides([("attention", "decode", "reference")]):
        model, config = _model(folder)
    assert CPUDecodeForward.build(model, _kv(config, 4, 0)) is None
    model, config = _model(checkpoints["qwen2"])
    assert CPUDecodeForward.build(model, _kv(config, 4, 0)) is None


def _greedy(folder, **engine_args) -> tuple[list[list[int]], int]:
    llm = LLM(str(folder), skip_tokenizer_init=True, show_progress=False, **engine_args)
    runner = llm.core.executor.runner
    calls = 0
    if runner.cpu_decode is not None:
        run = runner.cpu_decode.run

        def counted(batch):
            nonlocal calls
            calls += 1
            return run(batch)

        runner.cpu_decode.run = counted
    work = [{"prompt_token_ids": p} for p in prompts(5, seed=11, min_len=3, max_len=60)]
    out = llm.generate(work, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in out], calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_greedy_tokens_same_on_and_off(checkpoints, family: str) -> None:
    on, calls = _greedy(checkpoints[family])
    off, off_calls = _greedy(checkpoints[family], disable_cpu_decode_forward=True)
    assert calls > 10 and off_calls == 0  # decode steps did take it, and the switch turns it off
    assert on == off


def test_embedded_model_greedy_tokens_same_on_and_off() -> None:
    def run(**engine_args):
        llm = LLM(show_progress=False, **engine_args)
        assert (llm.core.executor.runner.cpu_decode is None) == bool(engine_args)
        out = llm.generate(["def fib(n):", "Write a haiku about caches."],
                           SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
        llm.shutdown()
        return [o.outputs[0].token_ids for o in out]

    assert run() == run(disable_cpu_decode_forward=True)
