"""Every fast path gives the same tokens as the plain path.

Prefix cache on/off, chunked prefill (7-token budget vs unlimited), page
sizes 1/16/64, preemption forced by a tiny pool, and any batch composition
or arrival order — for greedy and for seeded random sampling alike.

The prefix-cache cases must really read cached pages, or they could not catch
a cache bug: they assert hits, both within one step (prompts admitted together
share the pages the first of them writes) and across calls (the same workload
again on a warm cache, where every prompt hits).
"""

from __future__ import annotations

import random

import pytest

from tests.checkpoints import prompts
from tokenspeed import LLM, SamplingParams

SHARED = prompts(1, seed=11, min_len=40, max_len=40)[0]


def workload() -> list[list[int]]:
    """Prompts that share prefixes with each other (so the cache has hits) plus unrelated ones."""
    own = prompts(6, seed=2, min_len=5, max_len=50)
    return [SHARED + p[:9] for p in own[:3]] + own[3:] + [SHARED[:20] + own[0][:3]]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=123, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, max_tokens=24, ignore_eos=True,
                   repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, seed=7),
]


def run(folder, params, order=None, repeat=1, **engine_args) -> list[list[int]]:
    """Each prompt's tokens (of the last of `repeat` runs of the workload on one engine)."""
    batch = workload()
    order = order or list(range(len(batch)))
    llm = LLM(str(folder), skip_tokenizer_init=True, **engine_args)
    for attempt in range(repeat):
        outputs = llm.generate([{"prompt_token_ids": batch[i]} for i in order], params)
        cached = [o.num_cached_tokens for o in outputs]
        if engine_args.get("enable_prefix_caching"):
            assert sum(cached) > 0, "the prefix-cache case never read a cached page"
        if attempt > 0:
            assert all(cached), f"a warm cache must serve every prompt's first page: {cached}"
    by_index = {i: o.outputs[0].token_ids for i, o in zip(order, outputs)}
    return [by_index[i] for i in range(len(batch))]


@pytest.fixture(scope="module")
def folder(checkpoints):
    return checkpoints["llama"]


@pytest.fixture(scope="module", params=range(len(PARAMS)), ids=["greedy", "top-p-k", "penalties-min-p"])
def baseline(request, folder):
    params = PARAMS[request.param]
    return params, run(folder, params, enable_prefix_caching=False, page_size=16)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=True, repeat=2),
        dict(max_num_batched_tokens=7),
        dict(max_num_batched_tokens=7, enable_prefix_caching=True),
        dict(page_size=1),
        dict(page_size=64),
        dict(max_num_seqs=2),
        # Pool of 9 pages x 16 tokens: one max-length request fits, the batch does not -> preemption.
        dict(num_kv_pages=9, max_model_len=128, page_size=16),
        dict(num_kv_pages=9, max_model_len=128, page_size=16, max_num_batched_tokens=7),
    ],
    ids=["prefix-cache", "prefix-cache-warm", "chunk-7", "chunk-7-cache", "page-1", "page-64", "two-seqs", "preempt", "preempt-chunk"],
)
def test_fast_path_gives_same_tokens(folder, baseline, engine_args):
    params, expected = baseline
    assert run(folder, params, **engine_args) == expected


def test_arrival_order_and_batch_composition_do_not_matter(folder, baseline):
    params, expected = baseline
    order = list(range(len(expected)))
    random.Random(0).shuffle(order)
    assert run(folder, params, order=order) == expected
    # Each prompt alone (batch of one) gives the same tokens as in the batch.
    llm = LLM(str(folder), skip_tokenizer_init=True)
    for i, prompt in enumerate(workload()):
        alone = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        assert alone == expected[i]


def test_preemption_really_happens(folder):
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_pages=9, max_model_len=128, page_size=16)
    llm.generate([{"prompt_token_ids": p} for p in workload()], PARAMS[0])
    assert llm.core.scheduler.num_preemptions > 0, "the tiny pool should have forced a preemption"
