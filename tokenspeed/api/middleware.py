"""ASGI middleware that keeps one request from hurting the others.

`BodyLimit` refuses a body over `max_bytes` with 413 before any of it is
parsed: from `Content-Length` without reading a byte, or, for a chunked
body, as soon as the running count passes the limit. Parsing a 16 MB JSON
body and tokenising it used to stall the event loop, and with it `/health`
and every stream, for seconds.

`CatchUnexpected` turns an exception no handler knows into a 500 with an
error body in the caller's dialect. It sits inside Starlette's
`ServerErrorMiddleware`, which would answer the 500 too but then re-raise,
and uvicorn closes the connection of an app that raised: a client's next
request on its keep-alive connection was reset. Here the exception is
logged and stops.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tokenspeed.api.errors import APIError, error_body, from_exception

logger = logging.getLogger("tokenspeed.api")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, error: APIError, path: str, *, close: bool = False) -> None:
    body = json.dumps(error_body(error, path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the unread rest of the body would be taken for the next request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> APIError:
        return APIError(
            413, f"The request body is {size} bytes; this server accepts at most {self.max_bytes} "
                 f"(--max-request-body-bytes).", code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, self._too_large(declared.decode()), path, close=True)
            return
        # Read the whole body here (the app would anyway), counting, then hand it on.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, self._too_large(f"more than {self.max_bytes}"), path, close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that yields `messages` first, then whatever the server sends (e.g. disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


class CatchUnexpected:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:  # part of a response is out: only closing the connection can end it
                raise
            await send_error(send, from_exception(exc), scope.get("path", ""))
