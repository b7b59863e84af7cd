"""One engine request as the routes see it: started eagerly, observed, always cleaned up.

`start()` pulls the first delta before any response byte is sent, so invalid
parameters, a too-long prompt, a full queue or a dead engine become a proper
HTTP status instead of an error buried in a 200 stream. Whatever ends the
request early (client disconnect, cancellation, an exception in a route)
closes the engine iterator, which aborts the request and frees its KV pages;
the close runs in a shielded scope because Starlette cancels a disconnected
stream with an anyio cancel scope, where every unshielded `await` would be
cancelled again before the abort is sent.

When the output parsers need markers that the tokenizer counts as special
tokens (harmony's `<|channel|>`, Mistral's `[TOOL_CALLS]`), the request is
decoded with special tokens kept; the stop token that ends the output
(`<|return|>`, `</s>`) is then not part of the answer, and `hide_stop_token`
cuts its text off the last delta.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from tokenspeed.api.engine_client import EngineClient
from tokenspeed.api.metrics import RequestTimer
from tokenspeed.engine.outputs import PositionLogprobs
from tokenspeed.engine.stream import RequestDelta
from tokenspeed.errors import EngineDead
from tokenspeed.scheduler.sampling_params import SamplingParams

logger = logging.getLogger("tokenspeed.api")

class Generation:
    def __init__(
        self,
        engine: EngineClient,
        timer: RequestTimer,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hide_stop_token: bool = False,
    ) -> None:
        self.engine = engine
        self.timer = timer
        self.request_id = request_id
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_generated = 0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self._hide_stop_token = hide_stop_token
        self._iterator = engine.generate(request_id, prompt_token_ids, params)
        self._first: RequestDelta | None = None
        self._reasons: list[str] = []
        self._finished = False
        self._closed = False

    async def start(self) -> None:
        try:
            self._first = await self._iterator.__anext__()
        except StopAsyncIteration:
            await self.close()
            raise EngineDead(f"The engine ended request {self.request_id} without output.") from None
        except BaseException:
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """Every delta (the first one included) until the request finishes."""
        try:
            if self._first is None:
                await self.start()
            first, self._first = self._first, None
            if first is not None:
                yield self._observe(first)
            while not self._finished:
                try:
                    delta = await self._iterator.__anext__()
                except StopAsyncIteration:
                    raise EngineDead(f"The engine stopped streaming request {self.request_id}.") from None
                yield self._observe(delta)
        finally:
            await self.close()

    def _observe(self, delta: RequestDelta) -> RequestDelta:
        self.prompt_token_ids = delta.prompt_token_ids or self.prompt_token_ids
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self._hide_stop_token:
            for stream in delta.deltas:
                if stream.finish_reason == "stop" and isinstance(stream.stop_reason, int):
                    stream.text = stream.text.removesuffix(self.engine.tokenizer.decode([stream.stop_reason]))
        if delta.queue_time_s is not None:
            self.timer.queued(delta.queue_time_s)
        count = sum(len(d.token_ids) for d in delta.deltas)
        self.num_generated += count
        self.timer.tokens(count)
        self._reasons.extend(d.finish_reason for d in delta.deltas if d.finish_reason is not None)
        if delta.finished:
            self._finished = True
            self.timer.finished(self._reasons)
        return delta

    async def close(self) -> None:
        """Abort unless finished; idempotent, and immune to the caller being cancelled."""
        if self._closed:
            return
        self._closed = True
        if self._finished:
            return
        with anyio.CancelScope(shield=True):
            aclose = getattr(self._iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # the engine's own cleanup failed; the abort below still goes out
                    logger.debug("closing the stream of %s failed", self.request_id, exc_info=True)
            try:
                await self.engine.abort(self.request_id)
            except Exception:  # a dead engine has nothing left to abort
                logger.debug("abort of %s failed", self.request_id, exc_info=True)


@dataclass(slots=True)
class ChoiceOutput:
    """Everything one of the n samples produced (non-streaming responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def collect(generation: Generation) -> list[ChoiceOutput]:
    choices = {i: ChoiceOutput(i) for i in range(generation.params.n)}
    async for delta in generation.deltas():
        for stream in delta.deltas:
            choice = choices.setdefault(stream.index, ChoiceOutput(stream.index))
            choice.text += stream.text
            choice.token_ids.extend(stream.token_ids)
            if stream.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + stream.logprobs
            if stream.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = stream.finish_reason, stream.stop_reason
    return [choices[i] for i in sorted(choices)]


async def collect_all(generations: list[Generation]) -> list[list[ChoiceOutput]]:
    """`collect` several requests at once; if one fails, the others are cancelled (and so aborted)."""
    tasks = [asyncio.ensure_future(collect(g)) for g in generations]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge_streams(streams: list[AsyncIterator[RequestDelta]]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several requests' deltas as they come (completions with several prompts)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()

    async def pump(position: int, stream: AsyncIterator[RequestDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((position, delta))
            await queue.put((position, None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((position, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            position, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
