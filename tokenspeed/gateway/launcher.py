"""`tokenspeed serve MODEL --data-parallel-size N --gateway smg`: N replicas behind the smg router.

smg (the Rust gateway from PyPI) terminates HTTP (OpenAI and Anthropic
APIs), renders the chat template, tokenises, parses tool calls and reasoning,
and routes each request to a replica over gRPC with its cache-aware policy:
a request goes to the replica whose prefix cache already holds the longest
part of its prompt (it learns that from each replica's KV-event stream), so
an agent's next turn lands where its last turn's pages are.

Lifecycle:

* Start: the replicas first (`processes.replica_child`, one process each,
  each with its own cores or GPU), each checked healthy over gRPC; then smg,
  whose port opens only once the replicas can serve; the launcher says
  "serving" once smg reports ready.
* A replica dying: smg stops routing to it (its health checks and KV-event
  stream fail within seconds); its in-flight requests fail (their streams
  break, smg answers an error); the others keep serving. The launcher exits
  1 when no replica is left or when smg itself dies, after stopping the rest.
* SIGINT (Ctrl-C): replicas abort in-flight requests at once (each completes
  with finish_reason "abort"), smg stops; SIGTERM: smg stops accepting and
  drains, then the replicas drain. Either way every child group is gone
  when the launcher returns (SIGKILL after a grace), exit status 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

from tokenspeed.api.args import ListenOptions
from tokenspeed.api.settings import ServerSettings
from tokenspeed.config import EngineConfig, resolve_device
from tokenspeed.gateway.processes import Child, cpu_slices, free_port, replica_child, replica_gpus, stop_all
from tokenspeed.gateway.smg_router import API_KEY_ENV, REASONING_PARSERS, TOOL_CALL_PARSERS

logger = logging.getLogger("tokenspeed.gateway")

REPLICA_START_TIMEOUT_S = 900.0  # a large model's load on a GPU
ROUTER_START_TIMEOUT_S = 120.0
_POLL_S = 0.2
_SMG_SHUTDOWN_GRACE_S = 4


class _Stop:
    """SIGINT/SIGTERM received: remembered, acted on by the supervising loop."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = sig

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _replica_healthy(port: int) -> bool:
    import grpc
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = pb_grpc.TokenSpeedSchedulerStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return bool(reply.healthy)


def _router_ready(host: str, port: int) -> bool:
    address = "127.0.0.1" if host in ("0.0.0.0", "") else host
    address = f"[{address}]" if ":" in address else address
    try:
        with urllib.request.urlopen(f"http://{address}:{port}/readiness", timeout=1.0) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def smg_command(
    settings: ServerSettings,
    listen: ListenOptions,
    *,
    replica_ports: list[int],
    tokenizer_folder: Path,
    page_size: int,
    chat_template_file: Path | None,
    log_level: str,
) -> list[str]:
    command = [
        sys.executable, "-m", "tokenspeed.gateway.smg_router",
        "--host", listen.host,
        "--port", str(listen.port),
        "--worker-urls", *[f"grpc://127.0.0.1:{p}" for p in replica_ports],
        "--policy", "cache_aware",
        "--model-path", str(tokenizer_folder),
        "--block-size", str(page_size),  # the router hashes prompts in our page size
        # A session's next turn must stay where its prefix is: no diverting cache hits to warm others.
        "--worker-warmup-divert-every", "0",
        "--health-check-interval-secs", "1",
        "--shutdown-grace-period-secs", str(_SMG_SHUTDOWN_GRACE_S),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()),
        "--max-payload-size", str(settings.max_request_body_bytes),
        "--log-level", {"debug": "debug", "info": "info", "warning": "warn"}.get(log_level, "error"),
        "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    if settings.tool_call_parser is not None:
        command += ["--tool-call-parser", TOOL_CALL_PARSERS[settings.tool_call_parser]]
    if settings.reasoning_parser is not None:
        command += ["--reasoning-parser", REASONING_PARSERS[settings.reasoning_parser]]
    if chat_template_file is not None:
        command += ["--chat-template", str(chat_template_file)]
    return command


def _wait_until(ready: list[tuple[Child, object]], stop: _Stop, timeout_s: float, what: str) -> bool:
    """Poll each (child, check) until every check passes; False if a child exits, a signal or time ends it."""
    deadline = time.monotonic() + timeout_s
    pending = list(ready)
    while pending:
        if stop.signal is not None:
            return False
        for child, check in list(pending):
            code = child.returncode()
            if code is not None:
                print(f"error: {child.name} exited with code {code} while {what}", file=sys.stderr)
                return False
            if check():  # type: ignore[operator]
                pending.remove((child, check))
        if time.monotonic() > deadline:
            print(f"error: {', '.join(c.name for c, _ in pending)} not ready after {timeout_s:.0f} s",
                  file=sys.stderr)
            return False
        time.sleep(_POLL_S)
    return True


def run_gateway(
    config: EngineConfig, settings: ServerSettings, listen: ListenOptions, *, replicas: int, log_level: str
) -> int:
    """Start the replicas and smg, supervise them until a signal (0) or a failure (1); no orphans."""
    from tokenspeed.engine.model_files import resolve_model_folder

    tokenizer_folder = resolve_model_folder(config.tokenizer or config.model)
    gpus: list[str] | None = None
    if resolve_device(config.device).type == "cuda":
        try:
            gpus = replica_gpus(replicas)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    slices = None if gpus is not None else cpu_slices(sorted(os.sched_getaffinity(0)), replicas)
    ports = [free_port() for _ in range(replicas)]
    children = [
        replica_child(
            i, config, port=ports[i], served_model_name=settings.model_name,
            max_waiting_requests=listen.max_waiting_requests,
            cores=None if slices is None else slices[i], gpu=None if gpus is None else gpus[i],
            log_level=log_level,
        )
        for i in range(replicas)
    ]  # fmt: skip
    stop = _Stop()
    workdir = tempfile.TemporaryDirectory(prefix="tokenspeed-gateway-")
    router: Child | None = None
    status = 1
    try:
        for child in children:
            child.start()
        if not _wait_until([(c, lambda p=p: _replica_healthy(p)) for c, p in zip(children, ports)],
                           stop, REPLICA_START_TIMEOUT_S, "loading"):
            return 0 if stop.signal is not None else 1
        template = None
        if settings.chat_template is not None:
            template = Path(workdir.name) / "chat_template.jinja"
            template.write_text(settings.chat_template)
        router = Child(
            "smg",
            smg_command(settings, listen, replica_ports=ports, tokenizer_folder=tokenizer_folder,
                        page_size=config.page_size, chat_template_file=template, log_level=log_level),
            env={API_KEY_ENV: settings.api_key} if settings.api_key else {},
        )
        router.start()
        if not _wait_until([(router, lambda: _router_ready(listen.host, listen.port))],
                           stop, ROUTER_START_TIMEOUT_S, "starting"):
            return 0 if stop.signal is not None else 1
        print(f"tokenspeed: serving {settings.model_name!r} on http://{listen.host}:{listen.port} through smg "
              f"(cache-aware) over {replicas} replica(s) at gRPC ports {', '.join(map(str, ports))}",
              file=sys.stderr, flush=True)
        status = _supervise(router, children, stop)
        return status
    finally:
        _shutdown(router, children, stop.signal)
        stop.restore()
        workdir.cleanup()


def _supervise(router: Child, replicas: list[Child], stop: _Stop) -> int:
    gone: set[int] = set()
    while stop.signal is None:
        code = router.returncode()
        if code is not None:
            print(f"error: smg exited with code {code}; stopping the replicas", file=sys.stderr)
            return 1
        for i, replica in enumerate(replicas):
            code = replica.returncode()
            if code is not None and i not in gone:
                gone.add(i)
                print(f"tokenspeed: {replica.name} exited with code {code}; smg routes around it "
                      f"({len(replicas) - len(gone)} left)", file=sys.stderr, flush=True)
        if len(gone) == len(replicas):
            print("error: every replica has exited", file=sys.stderr)
            return 1
        time.sleep(_POLL_S)
    return 0


def _shutdown(router: Child | None, replicas: list[Child], received: int | None) -> None:
    from tokenspeed.grpc.server import DRAIN_S

    if received == signal.SIGINT:  # replicas abort in-flight requests now; smg stops
        if router is not None:
            router.signal(signal.SIGTERM)
        for replica in replicas:
            replica.signal(signal.SIGINT)
        stop_all(([router] if router else []) + replicas, None, _SMG_SHUTDOWN_GRACE_S + 2)
        return
    if router is not None:  # SIGTERM (or a failure): the router drains first, then the replicas
        stop_all([router], signal.SIGTERM, _SMG_SHUTDOWN_GRACE_S + 2)
    stop_all(replicas, signal.SIGTERM, DRAIN_S + 3)
