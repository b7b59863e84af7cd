"""The engine-core process: `python -m tokenspeed.engine.core_process` (started by `CoreClient`).

Why a process of its own: the GPU loop must never wait for the GIL while the
API process parses JSON, renders chat templates or detokenises, and a crash in
either must not take the other down silently. The loop is a busy loop while
there is work (drain every queued message, `step()`, send the step's updates
with fresh stats) and blocks on the input socket while idle, so an idle server
uses no CPU.

It never outlives the API process: PR_SET_PDEATHSIG asks the kernel for
SIGTERM when the parent goes, and the loop also compares `os.getppid()` with
the parent's pid (for kernels without prctl, or a parent that died before
prctl ran). torch is imported only after that, so a parent killed during the
multi-second import still leaves no orphan.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING

import zmq

from tokenspeed.engine import ipc
from tokenspeed.engine.stream import EngineStats
from tokenspeed.errors import TokenSpeedError
from tokenspeed.kvcache.tier_stats import as_report
from tokenspeed.scheduler.updates import RequestUpdate

if TYPE_CHECKING:
    from tokenspeed.engine.core import EngineCore

logger = logging.getLogger("tokenspeed.engine.core_process")

_PR_SET_PDEATHSIG = 1
_IDLE_POLL_MS = 500  # how often an idle loop checks that its parent lives
_SEND_LINGER_MS = 2000  # time a final message (error, shutdown) gets to leave before exit


class CoreLoop:
    """Owns the `EngineCore` in this process; runs until `Shutdown` or the parent goes."""

    def __init__(
        self, core: EngineCore, inbox: zmq.Socket[bytes], outbox: zmq.Socket[bytes], parent_pid: int
    ):
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.num_added = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self._not_started: set[str] = set()  # added, first token not out yet (prompt/cache counters)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while True:
            busy = self.core.has_unfinished()
            changed = False
            if poller.poll(0 if busy else _IDLE_POLL_MS):
                changed, stop = self._drain()
                if stop:
                    return
            if os.getppid() != self.parent_pid:
                logger.warning("parent process %d is gone; engine core exits", self.parent_pid)
                return
            updates: list[RequestUpdate] = []
            stepped = self.core.has_unfinished()
            if stepped:
                updates = self.core.step()
                self._count(updates)
                for request_id, error in self.core.take_failures():  # e.g. a grammar that did not compile
                    self._not_started.discard(request_id)
                    self._send(ipc.RequestFailed(request_id, type(error).__name__, str(error)))
            if stepped or changed:
                kv_events = self.core.scheduler.kv.events.drain()
                self._send(ipc.Outputs(updates, self.stats(), self.num_added, kv_events))

    def _drain(self) -> tuple[bool, bool]:
        """Handle every queued message; (anything handled, shutdown asked)."""
        handled = False
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return handled, False
            message = ipc.decode(frame)
            if isinstance(message, ipc.Shutdown):
                return handled, True
            self._handle(message)
            handled = True

    def _handle(self, message: ipc.Message) -> None:
        if isinstance(message, ipc.AddRequest):
            self.num_added += 1
            try:
                self.core.add_request(message.request_id, message.prompt_token_ids, message.params)
            except TokenSpeedError as exc:
                self._send(ipc.RequestFailed(message.request_id, type(exc).__name__, str(exc)))
                return
            self._not_started.add(message.request_id)
        elif isinstance(message, ipc.AbortRequest):
            self.core.abort(message.request_id)
            self._not_started.discard(message.request_id)
        elif isinstance(message, ipc.FinishStream):
            self.core.finish_stream(message.stream_id, message.reason, message.stop_reason)
        else:
            raise ipc.WireFormatError(f"{type(message).__name__} is not a message for the core")

    def _count(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            self.generation_tokens_total += len(update.new_token_ids)
            if update.new_token_ids and update.request_id in self._not_started:
                self._not_started.discard(update.request_id)
                self.prompt_tokens_total += update.num_prompt_tokens
                self.cached_tokens_total += update.num_cached_tokens

    def stats(self) -> EngineStats:
        scheduler = self.core.scheduler
        kv = scheduler.kv.stats()
        spec = scheduler.speculation_stats
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_pages_total=kv.total,
            kv_pages_free=kv.free,
            kv_pages_referenced=kv.referenced,
            kv_pages_cached=kv.cached_unreferenced,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            spec_method="" if spec is None else spec.method,
            spec_num_drafts=0 if spec is None else spec.num_drafts,
            spec_num_draft_tokens=0 if spec is None else spec.num_draft_tokens,
            spec_num_accepted_tokens=0 if spec is None else spec.num_accepted_tokens,
            spec_accepted_per_position=[] if spec is None else list(spec.accepted_per_position),
            num_retracted=scheduler.num_retracted,
            kv_tiers=as_report(scheduler.kv.tier_stats(), scheduler.kv.page_size),
        )

    def _send(self, message: ipc.Message) -> None:
        self.outbox.send(ipc.encode(message))


def exit_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGTERM this process when its parent dies (Linux); exit now if it already has."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is not None:
        try:
            libc = ctypes.CDLL(libc_name, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # not Linux: the loop's getppid() check still ends the process
    if os.getppid() != parent_pid:
        sys.exit(0)


def _error(exc: BaseException) -> tuple[str, str, str]:
    return type(exc).__name__, str(exc), traceback.format_exc()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="TokenSpeed engine-core process (started by the API server)."
    )
    parser.add_argument("--input", required=True, help="ZMQ address the API process sends requests on")
    parser.add_argument("--output", required=True, help="ZMQ address the API process receives outputs on")
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    exit_with_parent(args.parent_pid)
    logging.basicConfig(
        level=os.environ.get("TOKENSPEED_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s",
    )

    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(args.input)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs: the reader is the API process
    outbox.connect(args.output)
    try:
        return _serve(args, inbox, outbox)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=_SEND_LINGER_MS)
        context.term()


def _serve(args: argparse.Namespace, inbox: zmq.Socket[bytes], outbox: zmq.Socket[bytes]) -> int:
    try:
        from tokenspeed.config import EngineConfig
        from tokenspeed.engine.core import EngineCore
        from tokenspeed.executor.cpu_threads import reserve_api_core

        config = ipc.config_from_wire(EngineConfig, args.config)
        reserve_api_core()  # the API process runs beside this one: automatic CPU thread counts leave it a core
        core = EngineCore(config)
    except Exception as exc:
        from tokenspeed.errors import TokenSpeedError

        if not isinstance(exc, TokenSpeedError):  # a typed error is the user's to fix: its message says it all
            logger.exception("engine core failed to start")
        outbox.send(ipc.encode(ipc.StartupFailed(*_error(exc))))
        return 1
    stats = core.scheduler.kv.stats()
    ready = ipc.Ready(
        pid=os.getpid(),
        max_model_len=core.limits.max_model_len,
        vocab_size=core.limits.vocab_size,
        max_num_seqs=config.max_num_seqs,
        page_size=config.page_size,
        num_kv_pages=stats.total,
    )
    outbox.send(ipc.encode(ready))
    core.scheduler.kv.events.enabled = config.enable_kv_cache_events
    loop = CoreLoop(core, inbox, outbox, args.parent_pid)
    outbox.send(ipc.encode(ipc.Outputs([], loop.stats(), 0)))
    try:
        loop.run()
    except Exception as exc:
        logger.exception("engine core loop failed")
        outbox.send(ipc.encode(ipc.EngineFailed(*_error(exc))))
        return 1
    return 0


if __name__ == "__main__":
    exit_code = main()
    # Skip interpreter teardown (seconds of freeing torch modules and the KV pool):
    # the sockets are closed and the logs flushed; the OS reclaims the rest.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
