"""`tokenspeed serve`: run the API app under uvicorn on top of an engine process, and stop cleanly.

Lifecycle, and why:

* The engine process starts first (model load); the port opens only once it
  can serve, so a client never sees a listening server that cannot answer.
* Engine death: `/health` and new requests answer 503 at once (the app
  checks liveness), in-flight requests end with 503 / an error event, and
  after a short grace period (so load balancers and clients see the 503
  rather than a refused connection) uvicorn is told to exit; the process
  then exits with status 1, for a supervisor to restart it. A server that
  stays up with a dead engine would hang every agent talking to it.
* SIGINT (Ctrl-C): every in-flight request is aborted at once, so each
  stream ends with a last `finish_reason: "abort"` chunk and `[DONE]`, and
  the server exits within a second, quietly. (Left to uvicorn, the streams
  ran on until its graceful-shutdown timeout cancelled them, ~6 s later,
  with a traceback per stream.) A second Ctrl-C forces the exit.
* SIGTERM (a supervisor's stop): uvicorn stops accepting and drains
  in-flight requests for up to `--drain-timeout` seconds, then what is
  left is aborted the same way, before uvicorn's own timeout (a second
  later) would cancel it.
* Either way the engine process is shut down afterwards (no orphans) and
  the exit status is 0. uvicorn re-raises the signal it caught once it
  returns; our handler is installed underneath it so that re-raise lands
  here instead of killing the process before the engine is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from tokenspeed.api.args import ListenOptions, serve_config
from tokenspeed.api.settings import ServerSettings
from tokenspeed.config import EngineConfig

if TYPE_CHECKING:
    from tokenspeed.engine.async_engine import AsyncEngine

logger = logging.getLogger("tokenspeed.api")

DEAD_ENGINE_GRACE_S = 1.0  # how long 503s are served after engine death before exiting
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Signals:
    """Our handler for SIGINT/SIGTERM: abort startup, or just note a signal uvicorn re-raised."""

    def __init__(self, loop: asyncio.AbstractEventLoop, main: asyncio.Task[int]) -> None:
        self.loop = loop
        self.main = main
        self.serving = False
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in _SIGNALS}

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        self.received = sig
        if not self.serving:  # still loading the model: give up starting
            self.loop.call_soon_threadsafe(self.main.cancel)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _stopping_server(config: object, engine: AsyncEngine, drain_s: float) -> Any:
    """A `uvicorn.Server` whose signal handling also ends the engine's in-flight requests (see above)."""
    import uvicorn

    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

    def abort_all() -> None:
        task = loop.create_task(engine.abort_all())
        pending.add(task)
        task.add_done_callback(pending.discard)

    class StoppingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first and sig == signal.SIGINT:
                loop.call_soon_threadsafe(abort_all)
            elif first:
                loop.call_soon_threadsafe(loop.call_later, drain_s, abort_all)

    return StoppingServer(config)  # type: ignore[arg-type]


async def serve(config: EngineConfig, settings: ServerSettings, listen: ListenOptions) -> int:
    """Serve until a signal (exit status 0) or engine death (1)."""
    import uvicorn

    from tokenspeed.api.app import build_app
    from tokenspeed.engine.async_engine import AsyncEngine

    main = asyncio.current_task()
    assert main is not None
    signals = _Signals(asyncio.get_running_loop(), main)
    engine = AsyncEngine(config, max_waiting_requests=listen.max_waiting_requests)
    dead = asyncio.Event()
    try:
        await engine.start()
        engine.on_dead = dead.set
        server = _stopping_server(
            uvicorn.Config(
                build_app(engine, settings),
                host=listen.host,
                port=listen.port,
                log_level=listen.uvicorn_log_level,
                access_log=listen.access_log,
                timeout_graceful_shutdown=math.ceil(listen.drain_timeout_s) + 1,  # after our abort
            ),
            engine,
            listen.drain_timeout_s,
        )
        watchdog = asyncio.create_task(_exit_when_dead(server, dead))
        signals.serving = True
        print(f"tokenspeed: serving {settings.model_name!r} on http://{listen.host}:{listen.port}",
              file=sys.stderr, flush=True)
        try:
            await server.serve()
        finally:
            watchdog.cancel()
        if not server.started:
            return 1  # could not bind (uvicorn logged why)
    finally:
        await engine.close()
        signals.restore()
    return 1 if dead.is_set() else 0


async def _exit_when_dead(server: object, dead: asyncio.Event) -> None:
    await dead.wait()
    logger.error("engine died; answering 503 for %.1f s, then exiting", DEAD_ENGINE_GRACE_S)
    await asyncio.sleep(DEAD_ENGINE_GRACE_S)
    server.should_exit = True  # type: ignore[attr-defined]


def run_server(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    config, settings, listen = serve_config(args, parser)
    try:
        return asyncio.run(serve(config, settings, listen))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("tokenspeed: interrupted while starting", file=sys.stderr)
        return 0
