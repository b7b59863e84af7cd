"""The engine-core process dies or fails to start: the front end notices at once, and nothing is orphaned."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from tokenspeed.config import EngineConfig
from tokenspeed.engine.async_engine import AsyncEngine
from tokenspeed.errors import ContextTooLong, EngineDead
from tokenspeed.scheduler.sampling_params import SamplingParams


def gone(pid: int) -> bool:
    """Exited and reaped (a zombie still has a /proc entry)."""
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="module")
def engines(loop):
    """A healthy engine and one that cannot start, started side by side (each start imports torch)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # see test_async_engine: thread pools thrash on 2 cores
    try:
        good = AsyncEngine(EngineConfig(model=None, max_model_len=512))
        bad = AsyncEngine(EngineConfig(model=None, max_model_len=1_000_000))

        async def start_both() -> list[BaseException | None]:
            return await asyncio.gather(good.start(), bad.start(), return_exceptions=True)

        results = loop.run_until_complete(start_both())
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    yield good, bad, results[1]
    loop.run_until_complete(good.close())
    loop.run_until_complete(bad.close())


def test_startup_failure_raises_the_child_error(engines, loop):
    _, bad, error = engines
    assert isinstance(error, ContextTooLong) and "max_position_embeddings" in str(error)
    assert any("Traceback" in note for note in error.__notes__)  # the child's traceback comes along
    assert not bad.is_healthy() and bad.pid is not None and gone(bad.pid)
    with pytest.raises(EngineDead):
        bad.generate("x", [1], SamplingParams())
    loop.run_until_complete(bad.close())


def test_killed_engine_process_fails_every_stream_fast(engines, loop):
    engine = engines[0]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400)

    async def scenario() -> None:
        assert engine.is_healthy() and engine.pid is not None
        dead_at: list[float] = []
        engine.on_dead = lambda: dead_at.append(time.monotonic())
        prompt = engine.tokenizer.encode("for i in range(10):")
        streams = [engine.generate(f"r{i}", prompt, params) for i in range(3)]
        for stream in streams:
            assert (await stream.__anext__()).deltas  # all three are running

        async def drain(stream) -> BaseException | None:
            try:
                async for _ in stream:
                    pass
            except EngineDead as exc:
                return exc
            return None

        waiting = [asyncio.create_task(drain(s)) for s in streams]
        killed_at = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        errors = await asyncio.wait_for(asyncio.gather(*waiting), 1.0)
        assert all(isinstance(e, EngineDead) and "SIGKILL" in str(e) for e in errors), errors
        assert not engine.is_healthy()
        assert len(dead_at) == 1 and dead_at[0] - killed_at < 1.0
        with pytest.raises(EngineDead, match="SIGKILL"):
            engine.generate("late", prompt, params)
        await engine.close()
        assert gone(engine.pid) and len(dead_at) == 1

    loop.run_until_complete(scenario())


def test_core_process_exits_when_its_parent_dies():
    # A parent starts a child that arms exit_with_parent (what core_process does first), then dies.
    child = (
        "import sys, time; from tokenspeed.engine.core_process import exit_with_parent; "
        "exit_with_parent(int(sys.argv[1])); print('armed', flush=True); time.sleep(60)"
    )
    parent = (
        "import os, subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())]); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child_pid = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "armed"
    assert not gone(child_pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5.0
    while not gone(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child_pid), "the child outlived its parent"
