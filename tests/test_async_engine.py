"""`AsyncEngine` against a real engine-core process (embedded model, CPU).

One engine serves the whole module: starting a core process costs seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from tokenspeed import LLM
from tokenspeed.config import EngineConfig
from tokenspeed.engine.async_engine import AsyncEngine
from tokenspeed.engine.outputs import CompletionOutput
from tokenspeed.engine.stream import RequestDelta
from tokenspeed.errors import ContextTooLong, EngineOverloaded, InvalidRequest
from tokenspeed.scheduler.sampling_params import SamplingParams

MAX_NUM_SEQS = 16


@pytest.fixture(scope="module")
def engine(loop):
    # One intra-op thread in the core process: on a small shared CPU two processes'
    # thread pools thrash each other (an order of magnitude slower).
    with env(OMP_NUM_THREADS="1"):
        engine = AsyncEngine(EngineConfig(model=None, max_model_len=512, max_num_seqs=MAX_NUM_SEQS))
        loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.close())
    assert engine.pid is not None and not os.path.exists(f"/proc/{engine.pid}")


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(max_model_len=512, max_num_seqs=MAX_NUM_SEQS, show_progress=False)
    torch.set_num_threads(threads)


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class Collected:
    deltas: list[RequestDelta] = field(default_factory=list)
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)


async def collect(
    engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> Collected:
    """Concatenate a request's deltas per stream, checking the per-delta invariants on the way."""
    result = Collected()
    async for delta in engine.generate(request_id, prompt, params):
        assert not (result.deltas and result.deltas[-1].finished), "a delta after the finished one"
        result.deltas.append(delta)
        for d in delta.deltas:
            out = result.outputs.setdefault(d.index, CompletionOutput(d.index, "", [], None, None))
            assert out.finish_reason is None, "a stream changed after its last delta"
            out.text += d.text
            out.token_ids.extend(d.token_ids)
            if params.logprobs is not None:
                assert d.logprobs is not None and len(d.logprobs) == len(d.token_ids)
                out.logprobs = (out.logprobs or []) + d.logprobs
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
    assert result.deltas[-1].finished
    return result


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def wait_until(loop, predicate, timeout: float = 10.0) -> None:
    async def poll() -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)

    loop.run_until_complete(poll())


def test_streamed_outputs_equal_offline(engine, llm, loop):
    prompt = engine.tokenizer.encode("def fib(n):")
    cases = [
        greedy(max_tokens=10, logprobs=2, prompt_logprobs=1),
        greedy(max_tokens=8, n=2),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=2, ignore_eos=True),
    ]
    expected = llm.generate([{"prompt_token_ids": prompt}] * len(cases), cases)
    full = expected[0].outputs[0].text
    assert len(full) > 8
    stop_hit = full[len(full) // 2 : len(full) // 2 + 3]
    stop_pending = full[-3:] + "\u2603"  # its prefix ends the text: held back until the stream ends
    stop_cases = [
        greedy(max_tokens=10, stop=[stop_hit]),
        greedy(max_tokens=10, stop=[stop_pending]),
        greedy(max_tokens=10, stop=[stop_hit], include_stop_str_in_output=True, n=2),
    ]
    expected += llm.generate([{"prompt_token_ids": prompt}] * len(stop_cases), stop_cases)
    cases += stop_cases
    assert expected[3].outputs[0].finish_reason == "stop" and expected[4].outputs[0].finish_reason == "length"

    async def stream_all() -> list[Collected]:
        return await asyncio.gather(*(collect(engine, f"parity-{i}", prompt, p) for i, p in enumerate(cases)))

    for params, want_request, got in zip(cases, expected, loop.run_until_complete(stream_all())):
        assert len(got.outputs) == params.n
        for want in want_request.outputs:
            have = got.outputs[want.index]
            assert have.text == want.text, params
            assert have.token_ids == want.token_ids, params
            assert (have.finish_reason, have.stop_reason) == (want.finish_reason, want.stop_reason), params
            if want.logprobs is not None:
                assert have.logprobs is not None
                assert [sorted(p) for p in have.logprobs] == [sorted(p) for p in want.logprobs]
                assert [p[t].logprob for p, t in zip(have.logprobs, have.token_ids)] == pytest.approx(
                    [p[t].logprob for p, t in zip(want.logprobs, want.token_ids)], abs=1e-4
                )
        first = got.deltas[0]
        assert first.prompt_token_ids == prompt
        if params.prompt_logprobs is not None:
            assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt)
            assert all(d.prompt_logprobs is None for d in got.deltas[1:])


def test_many_concurrent_requests_and_cancelled_streams_free_their_pages(engine, loop):
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(f"request number {i}: ") for i in range(50)]
    generated_before = engine.stats().generation_tokens_total

    async def scenario() -> None:
        done = asyncio.gather(
            *(collect(engine, f"many-{i}", p, greedy(max_tokens=4)) for i, p in enumerate(prompts))
        )
        started = [asyncio.Event() for _ in range(10)]
        iterators = [engine.generate(f"cancel-{i}", prompts[i], greedy(max_tokens=400)) for i in range(10)]

        async def consume(i: int) -> None:
            async for _ in iterators[i]:
                started[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(10)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        for i, task in enumerate(tasks):
            if i % 2:
                task.cancel()  # what a server does when its client disconnects
        for i, task in enumerate(tasks):
            if not i % 2:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await iterators[i].aclose()  # type: ignore[attr-defined]
        results = await asyncio.wait_for(done, 60)
        for result in results:
            assert len(result.outputs[0].token_ids) == 4 and result.outputs[0].finish_reason == "length"

    loop.run_until_complete(scenario())
    wait_until(loop, lambda: engine.stats().num_running + engine.stats().num_waiting == 0)
    stats = engine.stats()
    assert stats.kv_pages_referenced == 0, stats
    assert stats.kv_pages_free + stats.kv_pages_cached == stats.kv_pages_total
    generated = stats.generation_tokens_total - generated_before
    # The cancelled streams made a token or more each, but stopped long before their 400.
    assert 50 * 4 + 10 <= generated < 50 * 4 + 10 * 100
    assert stats.prompt_tokens_total >= sum(len(p) for p in prompts)


def test_validation_errors_are_typed_and_raised_by_generate(engine):
    ok = greedy(max_tokens=2)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate("v1", [], ok)
    with pytest.raises(ContextTooLong, match="512"):
        engine.generate("v2", [1] * 512, ok)
    with pytest.raises(InvalidRequest, match=r"\[0, 4096\)"):
        engine.generate("v3", [1, engine.vocab_size], ok)
    with pytest.raises(InvalidRequest, match=r"\[0, 4096\)"):
        engine.generate("v4", [-1], ok)
    with pytest.raises(InvalidRequest, match="max_num_seqs"):
        engine.generate("v5", [1, 2], greedy(max_tokens=2, n=MAX_NUM_SEQS + 1))


def test_duplicate_ids_abort_and_overload(engine, loop):
    prompt = engine.tokenizer.encode("while True:")

    async def scenario() -> None:
        first = engine.generate("dup", prompt, greedy(max_tokens=400))
        delta = await first.__anext__()
        assert delta.deltas[0].token_ids and not delta.finished
        with pytest.raises(InvalidRequest, match="already in use"):
            engine.generate("dup", prompt, greedy(max_tokens=2))
        await engine.abort("dup")
        rest = [d async for d in first]
        assert rest[-1].finished and rest[-1].deltas[0].finish_reason == "abort"

        # Fill every seat, then one waits: with max_waiting_requests=1 the next is refused.
        engine.max_waiting_requests = 1
        try:
            streams = [
                engine.generate(f"load-{i}", prompt, greedy(max_tokens=400)) for i in range(MAX_NUM_SEQS + 1)
            ]
            tasks = [asyncio.create_task(s.__anext__()) for s in streams]
            await asyncio.sleep(0)
            with pytest.raises(EngineOverloaded):  # the core has not seen them yet: counted in transit
                engine.generate("load-x", prompt, greedy(max_tokens=2))
            deadline = time.monotonic() + 10
            while engine.stats().num_waiting != 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            with pytest.raises(EngineOverloaded, match="max_waiting_requests=1"):
                engine.generate("load-x", prompt, greedy(max_tokens=2))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()  # type: ignore[attr-defined]
        finally:
            engine.max_waiting_requests = None

    loop.run_until_complete(scenario())
    wait_until(loop, lambda: engine.stats().num_running + engine.stats().num_waiting == 0)
    assert engine.stats().kv_pages_referenced == 0


def test_aborting_an_n_request_aborts_all_its_children(engine, loop):
    prompt = engine.tokenizer.encode("class Node:")

    async def scenario() -> None:
        stream = engine.generate("fan", prompt, greedy(max_tokens=400, n=3))
        first = await stream.__anext__()
        assert not first.finished
        with pytest.raises(InvalidRequest, match="collides"):  # "fan#1" is a live child's id
            await engine.generate("fan#1", prompt, greedy(max_tokens=2)).__anext__()
        await engine.abort("fan")
        rest = [d async for d in stream]
        assert rest[-1].finished
        finish = {d.index: d.finish_reason for delta in [first, *rest] for d in delta.deltas if d.finish_reason}
        assert finish == {0: "abort", 1: "abort", 2: "abort"}

    loop.run_until_complete(scenario())
    wait_until(loop, lambda: engine.stats().num_running + engine.stats().num_waiting == 0)
    assert engine.stats().kv_pages_referenced == 0
