"""A headless replica: the engine behind the `TokenSpeedScheduler` gRPC service, no HTTP.

`tokenspeed serve MODEL --grpc-port P` runs it in the foreground; the gateway
launcher (`tokenspeed/gateway/`) starts one per replica as
`python -m tokenspeed.grpc.server --config JSON ...`, with `--parent-pid` so
the kernel stops it when the launcher dies (no orphans even after SIGKILL).

Lifecycle, as `tokenspeed serve` over HTTP (api/server.py): the port opens
once the model is loaded; SIGTERM stops accepting calls and lets in-flight
ones finish for up to `DRAIN_S` before they are cancelled; SIGINT aborts
in-flight requests at once (each stream completes with finish_reason
"abort"); both exit 0 after the engine process is shut down. If the engine
dies, health turns false and calls fail UNAVAILABLE for a short grace, then
the process exits 1 for its supervisor.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

import grpc
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc

from tokenspeed.config import EngineConfig

logger = logging.getLogger("tokenspeed.grpc")

DRAIN_S = 4.0
DEAD_ENGINE_GRACE_S = 1.0
_MAX_MESSAGE_BYTES = 64 * 2**20  # prompts of a few 100K tokens as varints, with room to spare


@dataclasses.dataclass(slots=True)
class GrpcOptions:
    host: str
    port: int
    served_model_name: str
    max_waiting_requests: int | None = None


async def serve_grpc(config: EngineConfig, options: GrpcOptions) -> int:
    """Serve until SIGINT/SIGTERM (exit status 0) or engine death (1); 1 if the port cannot be bound."""
    from tokenspeed.engine.async_engine import AsyncEngine
    from tokenspeed.grpc.service import SchedulerService, ServiceInfo

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    stop = asyncio.Event()
    received: list[int] = []
    serving = False

    def on_signal(sig: int) -> None:
        received.append(sig)
        if not serving:
            main.cancel()  # still loading the model: give up starting
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    engine = AsyncEngine(config.replace(enable_kv_cache_events=True),
                         max_waiting_requests=options.max_waiting_requests)
    dead = asyncio.Event()
    try:
        await engine.start()
        engine.on_dead = dead.set
        service = SchedulerService(
            engine,
            ServiceInfo(
                served_model_name=options.served_model_name,
                model_path=config.model or str(engine.model_folder),
                tokenizer_folder=engine.model_folder if config.tokenizer is None else Path(config.tokenizer),
                server_args=dataclasses.asdict(config),
            ),
        )
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_TokenSpeedSchedulerServicer_to_server(service, server)
        try:
            bound = server.add_insecure_port(f"{options.host}:{options.port}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            print(f"error: cannot listen on {options.host}:{options.port}", file=sys.stderr)
            return 1
        await server.start()
        serving = True
        print(f"tokenspeed: gRPC TokenSpeedScheduler serving {options.served_model_name!r} "
              f"on {options.host}:{bound} (pid {os.getpid()})", file=sys.stderr, flush=True)
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(dead.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        if dead.is_set():
            logger.error("engine died; answering UNAVAILABLE for %.1f s, then exiting", DEAD_ENGINE_GRACE_S)
            await asyncio.sleep(DEAD_ENGINE_GRACE_S)
            await server.stop(0)
        elif received and received[0] == signal.SIGINT:
            await engine.abort_all()  # every stream completes with finish_reason "abort"
            await server.stop(1.0)
        else:
            await server.stop(DRAIN_S)  # SIGTERM: finish what runs, refuse new calls
    finally:
        await engine.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 1 if dead.is_set() else 0


def run_grpc_server(config: EngineConfig, options: GrpcOptions) -> int:
    try:
        return asyncio.run(serve_grpc(config, options))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("tokenspeed: interrupted while starting", file=sys.stderr)
        return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenspeed.grpc.server`: one replica of the gateway launcher."""
    from tokenspeed.engine import ipc
    from tokenspeed.engine.core_process import exit_with_parent

    parser = argparse.ArgumentParser(description="TokenSpeed replica: the engine behind a gRPC service.")
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--max-waiting-requests", type=int, default=None)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process goes")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s replica %(levelname)s %(name)s: %(message)s")
    config = ipc.config_from_wire(EngineConfig, args.config)
    options = GrpcOptions(args.host, args.port, args.served_model_name, args.max_waiting_requests)
    with contextlib.suppress(KeyboardInterrupt):
        return run_grpc_server(config, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
