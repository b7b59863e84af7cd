"""The engine-core loop's side of the protocol, in-process (inproc:// sockets, loop on a thread)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from tokenspeed.config import EngineConfig
from tokenspeed.engine import ipc
from tokenspeed.engine.core import EngineCore
from tokenspeed.engine.core_process import CoreLoop
from tokenspeed.scheduler.sampling_params import SamplingParams


class LoopHarness:
    def __init__(self, core: EngineCore) -> None:
        self.context = zmq.Context()
        self.to_loop = self.context.socket(zmq.PUSH)
        self.to_loop.bind("inproc://in")
        self.from_loop = self.context.socket(zmq.PULL)
        self.from_loop.bind("inproc://out")
        inbox = self.context.socket(zmq.PULL)
        inbox.connect("inproc://in")
        outbox = self.context.socket(zmq.PUSH)
        outbox.connect("inproc://out")
        self.loop = CoreLoop(core, inbox, outbox, os.getppid())
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as exc:
            self.error = exc
        finally:
            self.loop.inbox.close(linger=0)
            self.loop.outbox.close(linger=1000)

    def send(self, message: ipc.Message) -> None:
        self.to_loop.send(ipc.encode(message))

    def recv(self, timeout_ms: int = 10_000) -> ipc.Message:
        assert self.from_loop.poll(timeout_ms), "the loop sent nothing"
        return ipc.decode(self.from_loop.recv())

    def recv_until_idle(self) -> tuple[list[ipc.Message], ipc.Outputs]:
        """Messages up to the first Outputs that shows an idle engine."""
        seen: list[ipc.Message] = []
        while True:
            message = self.recv()
            seen.append(message)
            if (
                isinstance(message, ipc.Outputs)
                and message.stats.num_running + message.stats.num_waiting == 0
            ):
                return seen, message

    def close(self) -> None:
        self.to_loop.close(linger=0)
        self.from_loop.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(EngineConfig(model=None, max_model_len=256, num_kv_pages=64))


@pytest.fixture
def harness(core) -> Iterator[LoopHarness]:
    h = LoopHarness(core)
    yield h
    if h.thread.is_alive():
        h.send(ipc.Shutdown())
        h.thread.join(10)
    h.close()


def test_requests_run_fail_and_abort_through_the_loop(harness):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5)
    harness.send(ipc.AddRequest("a", [5, 6, 7, 8, 9], params))
    harness.send(ipc.AddRequest("a", [5, 6], params))  # the id is live: refused, typed
    harness.send(ipc.AddRequest("long", [5, 6, 7], SamplingParams(max_tokens=240, ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    failed: list[ipc.RequestFailed] = []
    while "a" not in tokens or len(tokens["a"]) < 5:
        message = harness.recv()
        if isinstance(message, ipc.RequestFailed):
            failed.append(message)
        elif isinstance(message, ipc.Outputs):
            for update in message.updates:
                tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
    assert [(f.request_id, f.error_type) for f in failed] == [("a", "InvalidRequest")]
    assert "already in use" in failed[0].message
    harness.send(ipc.AbortRequest("long"))
    messages, last = harness.recv_until_idle()
    for message in messages:
        if isinstance(message, ipc.Outputs):
            for update in message.updates:
                tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
    stats = last.stats
    assert last.num_added == 3
    assert (
        stats.kv_pages_referenced == 0 and stats.kv_pages_free + stats.kv_pages_cached == stats.kv_pages_total
    )
    assert len(tokens["a"]) == 5 and 1 <= len(tokens["long"]) < 240
    assert stats.prompt_tokens_total == 5 + 3
    assert stats.generation_tokens_total == len(tokens["a"]) + len(tokens["long"])
    harness.send(ipc.Shutdown())
    harness.thread.join(10)
    assert not harness.thread.is_alive() and harness.error is None


def test_finish_stream_ends_a_stream_and_garbage_stops_the_loop(harness):
    harness.send(ipc.AddRequest("s", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True)))
    while True:  # until the first token is out
        message = harness.recv()
        if isinstance(message, ipc.Outputs) and message.updates:
            break
    harness.send(ipc.FinishStream("s", "stop", "xyz"))  # what the front end does on a stop string
    _, last = harness.recv_until_idle()
    assert last.stats.kv_pages_referenced == 0
    harness.to_loop.send(msgpack.packb(["launch_missiles", {}]))
    harness.thread.join(10)
    assert isinstance(harness.error, ipc.WireFormatError)  # core_process turns this into EngineFailed
