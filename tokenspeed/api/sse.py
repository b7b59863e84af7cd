"""Server-sent events framing, and running work that stops when its client goes away.

OpenAI streams bare `data:` lines ending with `data: [DONE]`; Anthropic
names each event (`event: message_start`, ...). Proxies must not buffer
either, hence the headers.

Non-streaming requests need disconnect handling too: an agent that times out
and retries would otherwise leave the abandoned generation running to
`max_tokens`, holding KV pages. `cancel_on_disconnect` races the work with
the ASGI `http.disconnect` message (the body has been read by then, so the
next message can only be the disconnect).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenspeed.api.errors import APIError

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def data(payload: Any) -> str:
    return f"data: {_dumps(payload)}\n\n"


def event(name: str, payload: Any) -> str:
    return f"event: {name}\ndata: {_dumps(payload)}\n\n"


def response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=_HEADERS)


class ClientDisconnected(APIError):
    def __init__(self) -> None:
        super().__init__(499, "The client closed the connection.")


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    task: asyncio.Task[T] = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()
        if not task.done():  # we were cancelled ourselves (shutdown): the work must not outlive us
            task.cancel()
