"""`AsyncEngine`: the API server's engine, with the `EngineCore` in a process of its own.

This process keeps the text side (tokenizer, incremental detokenisation, stop
strings, logprob decoding: the same `OutputProcessor` as the offline `LLM`, so
streamed and offline outputs agree), and the core process keeps the tokens.
Everything a request can be refused for is checked here, in `generate()`,
before anything is sent, so a bad request costs the core nothing and the
server can answer 4xx before it starts a stream.

Each request has one output slot; new deltas are merged into it until the
reader takes them, so a slow client never makes a queue grow. Leaving the
iterator early (client disconnect: `aclose()`, cancellation, garbage
collection) aborts the request in the core, which frees its KV pages.

Liveness: a watchdog polls the child every 100 ms; once it is gone every
stream raises `EngineDead`, `is_healthy()` turns False and `on_dead` fires,
so the server can fail fast and exit instead of hanging.

Single-threaded: call everything from the event loop that ran `start()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenspeed.config import EngineConfig
from tokenspeed.engine import ipc
from tokenspeed.engine.core_client import CoreClient, describe_exit
from tokenspeed.engine.model_files import eos_token_ids, is_preset, load_tokenizer, resolve_model_folder
from tokenspeed.engine.output_processor import OutputProcessor
from tokenspeed.engine.stream import EngineStats, RequestDelta, merge_deltas
from tokenspeed.errors import EngineDead, EngineOverloaded, InvalidRequest
from tokenspeed.kvcache.events import KVEvent
from tokenspeed.models import ModelConfig
from tokenspeed.scheduler.admission import AdmissionLimits, check_admission
from tokenspeed.scheduler.sampling_params import SamplingParams

logger = logging.getLogger("tokenspeed.engine")

_WATCHDOG_INTERVAL_S = 0.1


@dataclass(slots=True)
class _RequestSlot:
    """Where the output reader leaves a request's deltas for its consumer."""

    request_id: str
    pending: RequestDelta | None = None
    error: BaseException | None = None
    finished: bool = False
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, delta: RequestDelta) -> None:
        self.pending = delta if self.pending is None else merge_deltas(self.pending, delta)
        self.finished = self.finished or delta.finished
        self.wakeup.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.wakeup.set()


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, max_waiting_requests: int | None = None) -> None:
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self.on_dead: Callable[[], None] | None = None
        # Prefix-cache page records of each step (config.enable_kv_cache_events), for a router.
        self.on_kv_events: Callable[[list[KVEvent]], None] | None = None
        # Known after start():
        self.tokenizer: Any = None
        self.model_folder = Path()
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_token_ids: tuple[int, ...] = ()
        self._client: CoreClient | None = None
        self._ready: ipc.Ready | None = None
        self._limits: AdmissionLimits | None = None
        self._processor = OutputProcessor(None, self._finish_stream)
        self._slots: dict[str, _RequestSlot] = {}
        self._stats = EngineStats()
        self._num_sent = 0  # AddRequests sent; the core reports how many it has taken
        self._num_taken = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._dead: str | None = None  # why the engine is unusable (dead, closed, not started)
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the core process and wait until its model is loaded; raises the child's error if it fails."""
        if self._client is not None:
            raise RuntimeError("AsyncEngine.start() was called twice")
        self.config.validate()
        self.model_folder = await asyncio.to_thread(resolve_model_folder, self.config.model)
        # The child gets the resolved folder (a hub download happens once, here), except for a
        # preset, whose name tells the core to make dummy weights.
        child_model = self.config.model if is_preset(self.config.model) else str(self.model_folder)
        self._client = CoreClient(self.config.replace(model=child_model))
        tokenizer_source = self.config.tokenizer or self.model_folder
        tokenizer = None
        if not self.config.skip_tokenizer_init:  # loads while the child loads the model
            loading = asyncio.to_thread(load_tokenizer, tokenizer_source, self.config.trust_remote_code)
            tokenizer = asyncio.ensure_future(loading)
        try:
            ready = await self._client.start()
            self.tokenizer = await tokenizer if tokenizer is not None else None
            model_config = ModelConfig.from_pretrained(self.model_folder)
        except BaseException:
            if tokenizer is not None and not tokenizer.done():
                tokenizer.cancel()
            elif tokenizer is not None and not tokenizer.cancelled():
                tokenizer.exception()  # the engine's error is the one to report; this one is retrieved, unlogged
            await self._client.close()
            self._dead = "The engine failed to start."
            raise
        self._ready = ready
        self._limits = AdmissionLimits(
            max_model_len=ready.max_model_len,
            max_num_seqs=ready.max_num_seqs,
            page_size=ready.page_size,
            num_kv_pages=ready.num_kv_pages,
            vocab_size=ready.vocab_size,
        )
        self.eos_token_ids = eos_token_ids(self.model_folder, model_config, self.tokenizer)
        self.max_model_len = self._ready.max_model_len
        self.vocab_size = self._ready.vocab_size
        self._processor = OutputProcessor(self.tokenizer, self._finish_stream)
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="tokenspeed-engine-reader"),
            asyncio.create_task(self._watch_process(), name="tokenspeed-engine-watchdog"),
        ]
        logger.info("engine process %d ready (max_model_len %d)", self._ready.pid, self.max_model_len)

    async def close(self) -> None:
        """Stop the core process (no orphans); in-flight streams raise `EngineDead`."""
        if self._closed:
            return
        self._closed = True
        if self._dead is None:
            self._dead = "The engine is shut down."
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(self._dead)
        if self._client is not None:
            await self._client.close()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def is_healthy(self) -> bool:
        return self._ready is not None and self._dead is None

    @property
    def pid(self) -> int | None:
        """The engine-core process id (for operators and tests)."""
        return None if self._client is None else self._client.pid

    @property
    def limits(self) -> AdmissionLimits:
        """The engine's sizes (context, pages, batch), known once started."""
        if self._limits is None:
            raise EngineDead("The engine is not started.")
        return self._limits

    def stats(self) -> EngineStats:
        """The latest stats the core sent (it sends them after every step and every handled message)."""
        return dataclasses.replace(self._stats)

    # ---- requests ------------------------------------------------------------------------

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestDelta, None]:
        """Validate now (raising typed errors from this call), return the request's delta stream.

        The request reaches the core on the iterator's first `__anext__`; an iterator
        never iterated costs nothing. Leaving it early aborts the request.
        """
        self._check_alive()
        prompt = list(prompt_token_ids)
        self._validate(request_id, prompt, params)
        self._check_load()
        params = dataclasses.replace(params, eos_token_ids=self.eos_token_ids)
        return self._stream(request_id, prompt, params)

    def is_running(self, request_id: str) -> bool:
        """True while a request with this id streams (submitted, not finished or aborted)."""
        slot = self._slots.get(request_id)
        return slot is not None and not slot.finished and self._dead is None

    async def abort(self, request_id: str) -> None:
        """End a request now: its stream yields a last delta with finish_reason "abort"."""
        slot = self._slots.get(request_id)
        if slot is None or slot.finished or self._dead is not None:
            return
        self._abort_in_core(request_id)
        delta = self._processor.abort_delta(request_id)
        if delta is not None:
            slot.push(delta)

    async def abort_all(self) -> None:
        """End every request now (the server is stopping): each stream yields its last delta, "abort"."""
        for request_id in list(self._slots):
            await self.abort(request_id)

    async def _stream(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestDelta, None]:
        slot = self._submit(request_id, prompt, params)
        try:
            while True:
                await slot.wakeup.wait()
                slot.wakeup.clear()
                if slot.error is not None:
                    raise slot.error
                delta, slot.pending = slot.pending, None
                if delta is None:
                    continue
                yield delta
                if delta.finished:
                    return
        finally:
            self._release(slot)

    def _submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> _RequestSlot:
        self._check_alive()
        if request_id in self._slots:  # a second generate() with this id was iterated first
            raise InvalidRequest(f"Request id {request_id!r} is already in use.")
        children = self._processor.add_request(request_id, None, prompt, params)
        slot = self._slots[request_id] = _RequestSlot(request_id)
        sent: list[str] = []
        try:
            for child in children:  # n > 1: n requests sharing the prompt (engine/fan_out.py)
                self._send(ipc.AddRequest(child.request_id, prompt, child.params))
                sent.append(child.request_id)
                self._num_sent += 1
        except BaseException:  # forget the request entirely; abort the children that reached the core
            del self._slots[request_id]
            with contextlib.suppress(Exception):  # a send that failed once may fail again
                for core_id in sent:
                    self._send(ipc.AbortRequest(core_id))
            self._processor.abort_delta(request_id)
            raise
        return slot

    def _release(self, slot: _RequestSlot) -> None:
        """The consumer is done with `slot`: forget it, and abort it in the core if it still runs."""
        if self._slots.get(slot.request_id) is slot:
            del self._slots[slot.request_id]
        if slot.finished or slot.error is not None:
            return
        if self._dead is None:
            self._abort_in_core(slot.request_id)
        self._processor.abort_delta(slot.request_id)

    def _abort_in_core(self, request_id: str) -> None:
        """Abort every core request of a live request (its n children)."""
        for core_id in self._processor.core_request_ids(request_id):
            self._send(ipc.AbortRequest(core_id))

    # ---- admission ---------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._ready is None and self._dead is None:
            raise EngineDead("The engine is not started.")
        if self._dead is not None:
            raise EngineDead(self._dead)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        assert self._limits is not None
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("The request id must be a non-empty string.")
        if request_id in self._slots:
            raise InvalidRequest(f"Request id {request_id!r} is already in use.")
        check_admission(prompt, params, self._limits)

    def _check_load(self) -> None:
        """`EngineOverloaded` once `max_waiting_requests` requests would wait in the core's queue.

        The core's count is one message old, so requests sent since are added
        to it, minus the free seats they will probably take.
        """
        limit = self.max_waiting_requests
        if limit is None:
            return
        assert self._ready is not None
        stats = self._stats
        in_transit = self._num_sent - self._num_taken
        free_seats = 0 if stats.num_waiting else max(0, self._ready.max_num_seqs - stats.num_running)
        waiting = stats.num_waiting + max(0, in_transit - free_seats)
        if waiting >= limit:
            raise EngineOverloaded(
                f"{waiting} requests are waiting for the engine (max_waiting_requests={limit}); retry later."
            )

    # ---- the core's side ---------------------------------------------------------------------

    def _send(self, message: ipc.Message) -> None:
        assert self._client is not None
        self._client.send(message)

    def _finish_stream(self, stream_id: str, reason: str, stop_reason: str) -> None:
        """A stop string ended this stream: tell the core to free it (called by the OutputProcessor)."""
        if self._dead is None:
            self._send(ipc.FinishStream(stream_id, reason, stop_reason))

    async def _read_outputs(self) -> None:
        assert self._client is not None
        try:
            while True:
                self._on_message(await self._client.recv())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("engine output reader failed")
            self._mark_dead(f"Reading the engine's outputs failed: {exc!r}")

    def _on_message(self, message: ipc.Message) -> None:
        if isinstance(message, ipc.Outputs):
            self._stats = message.stats
            self._num_taken = message.num_added
            if message.kv_events and self.on_kv_events is not None:
                self.on_kv_events(message.kv_events)
            for delta in self._processor.process_deltas(message.updates):
                slot = self._slots.get(delta.request_id)
                if slot is not None:
                    slot.push(delta)
        elif isinstance(message, ipc.RequestFailed):
            request_id = self._processor.parent_of(message.request_id)
            if request_id is None:
                return  # its request was aborted or failed already
            self._abort_in_core(request_id)  # the failed child's siblings
            self._processor.abort_delta(request_id)
            slot = self._slots.get(request_id)
            if slot is not None:
                slot.fail(ipc.error_from_wire(message.error_type, message.message))
        elif isinstance(message, ipc.EngineFailed):
            logger.error("engine core failed:\n%s", message.traceback)
            self._mark_dead(f"The engine core failed: {message.error_type}: {message.message}")
        else:
            logger.warning("ignoring unexpected %s from the engine process", type(message).__name__)

    async def _watch_process(self) -> None:
        assert self._client is not None
        while True:
            await asyncio.sleep(_WATCHDOG_INTERVAL_S)
            code = self._client.returncode()
            if code is not None:
                self._mark_dead(f"The engine process {describe_exit(code)}.")
                return

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        logger.error("engine is dead: %s", reason)
        self._fail_all(reason)
        callback = self.on_dead
        if callback is not None:
            try:
                callback()
            except Exception:
                logger.exception("on_dead callback failed")

    def _fail_all(self, reason: str) -> None:
        for slot in self._slots.values():
            if not slot.finished:
                slot.fail(EngineDead(reason))
