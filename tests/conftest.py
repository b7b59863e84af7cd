"""Shared fixtures. Every test is followed by a KV-page accounting check on every live engine."""

from __future__ import annotations

import asyncio
import os
import weakref
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from tests.checkpoints import make_checkpoint  # noqa: E402
from tokenspeed.engine.core import EngineCore  # noqa: E402

_LIVE_CORES: weakref.WeakSet[EngineCore] = weakref.WeakSet()
_original_init = EngineCore.__init__


def _recording_init(self: EngineCore, *args: object, **kwargs: object) -> None:
    _original_init(self, *args, **kwargs)  # type: ignore[arg-type]
    _LIVE_CORES.add(self)


EngineCore.__init__ = _recording_init  # type: ignore[method-assign]

# The tiny test models are all overhead: one torch thread is as fast as two on an idle
# 2-core machine and several times faster when the server tests' subprocesses share it.
if not torch.cuda.is_available():
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def kv_pages_accounted():
    """No leaks: free + referenced + cached == total, and idle engines reference no page."""
    yield
    for core in list(_LIVE_CORES):
        kv = core.scheduler.kv
        kv.check_invariants()
        if not core.has_unfinished():
            assert kv.stats().referenced == 0, f"idle engine still references pages: {kv.stats()}"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: make_checkpoint(family, root / family) for family in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.fixture(scope="module")
def loop():
    """One event loop per module, for tests that drive an `AsyncEngine` from sync code."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
