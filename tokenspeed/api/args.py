"""Command-line flags of `tokenspeed serve`, grouped as `--help` shows them.

Engine flags are `engine_args.add_engine_args`, shared with every other
subcommand, so a flag that works for `tokenspeed generate` works here. The
model may be given positionally (`tokenspeed serve Qwen/Qwen3-8B`, like
`vllm serve`) or as `--model`; giving two different ones is an error.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from tokenspeed.api.parsers.reasoning import REASONING_PARSERS
from tokenspeed.api.parsers.registry import TOOL_FORMATS
from tokenspeed.api.settings import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_STORED_RESPONSES,
    ServerSettings,
)
from tokenspeed.config import EngineConfig
from tokenspeed.engine.segment_cache import DEFAULT_TOKENIZER_CACHE_TOKENS
from tokenspeed.engine_args import add_engine_args, engine_config_from_args

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(slots=True)
class ListenOptions:
    host: str
    port: int
    uvicorn_log_level: str
    access_log: bool
    max_waiting_requests: int | None
    drain_timeout_s: float = 4.0  # SIGTERM: how long in-flight requests may finish before they are aborted


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint folder, hub id, embedded-moe or preset:NAME; same as --model "
                             "(default: the embedded tiny model)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) clients must send; the first is reported (default: the model argument)")
    server.add_argument("--api-key", default=os.environ.get("TOKENSPEED_API_KEY"),
                        help="require this key (Bearer or x-api-key) on /v1/* (default: $TOKENSPEED_API_KEY, "
                             "or no authentication); prefer the variable: a command line is visible in `ps`")
    server.add_argument("--metrics-require-auth", action="store_true",
                        help="put /metrics behind the API key too (default: open, for scrapers)")
    server.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        metavar="BYTES", help="answer 413 to larger request bodies, before parsing them "
                                              "(default: %(default)s)")
    server.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                        metavar="N", help="most prompts one /v1/completions request may carry (default: %(default)s)")
    server.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES, metavar="N",
                        help="responses kept in memory for /v1/responses previous_response_id and GET, least "
                             "recently used dropped first; 0 stores none (default: %(default)s)")
    server.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                        help="answer 429 once N requests wait for the engine (default: unbounded)")
    server.add_argument("--drain-timeout", type=float, default=4.0, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight requests may run on before they are aborted (their "
                             "streams end with finish_reason abort); SIGINT aborts at once (default: %(default)s)")
    server.add_argument("--uvicorn-log-level", default="info", choices=_LOG_LEVELS,
                        help="uvicorn's log level (default: %(default)s)")
    server.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    scale = parser.add_argument_group("replicas and gateway")
    scale.add_argument("--grpc-port", type=int, default=None, metavar="PORT",
                       help="run headless: serve the TokenSpeedScheduler gRPC service on --host:PORT instead of "
                            "HTTP, for an smg gateway (default: HTTP)")
    scale.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                       help="engine replicas, each its own process (its own GPU; on the CPU its own share of "
                            "the cores); N > 1 needs --gateway (default: %(default)s)")
    scale.add_argument("--gateway", default=None, choices=["smg"],
                       help="front the replicas with this gateway on --host/--port: smg routes by prefix "
                            "cache over gRPC (default: our HTTP server, one replica)")
    chat = parser.add_argument_group("chat templating and output parsing")
    chat.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                      help="Jinja chat template (a file, or the template text) replacing the tokenizer's")
    chat.add_argument("--tokenizer-cache-tokens", type=int, default=DEFAULT_TOKENIZER_CACHE_TOKENS, metavar="N",
                      help="tokens of chat prompt text kept tokenised, message by message, so that an agent's "
                           "next turn tokenises only its new messages; 0 tokenises every prompt whole "
                           "(default: %(default)s, about 8 bytes a token)")
    chat.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_FORMATS), metavar="NAME",
                      help="format the model writes tool calls in, by vLLM's names: "
                           f"{', '.join(sorted(TOOL_FORMATS))}; needed for tools with tool_choice "
                           "auto/required/named (default: none)")
    chat.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS), metavar="NAME",
                      help="split the model's reasoning into reasoning_content / thinking blocks / reasoning "
                           f"items, by vLLM's names: {', '.join(sorted(REASONING_PARSERS))} (default: none)")
    add_engine_args(parser)


def serve_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> tuple[EngineConfig, ServerSettings, ListenOptions]:
    def fail(message: str) -> None:
        if parser is not None:
            parser.error(message)
        raise SystemExit(f"error: {message}")

    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            fail(f"two models given: {args.model_positional!r} and --model {args.model!r}")
        args.model = args.model_positional
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        fail("--max-waiting-requests must be at least 1")
    for flag in ("max_request_body_bytes", "max_prompts_per_request"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_stored_responses < 0:
        fail("--max-stored-responses must be at least 0")
    if not 0 <= args.drain_timeout <= 3600:
        fail("--drain-timeout must be between 0 and 3600 seconds")
    if args.tokenizer_cache_tokens < 0:
        fail("--tokenizer-cache-tokens must be at least 0")
    if args.metrics_require_auth and not args.api_key:
        fail("--metrics-require-auth needs an API key (--api-key or $TOKENSPEED_API_KEY)")
    if not 0 <= args.port <= 65535:
        fail(f"--port {args.port} is not a port number")
    if args.grpc_port is not None and not 0 <= args.grpc_port <= 65535:
        fail(f"--grpc-port {args.grpc_port} is not a port number")
    if args.data_parallel_size < 1:
        fail("--data-parallel-size must be at least 1")
    if args.data_parallel_size > 1 and args.gateway is None:
        fail("--data-parallel-size > 1 needs a gateway in front: add --gateway smg")
    if args.gateway is not None and args.grpc_port is not None:
        fail("--grpc-port runs one headless replica; --gateway starts its own replicas: give one of them")
    from tokenspeed.api.templating import load_chat_template

    settings = ServerSettings(
        served_model_names=list(args.served_model_name or [args.model or "embedded"]),
        api_key=args.api_key or None,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=load_chat_template(args.chat_template),
        metrics_require_auth=args.metrics_require_auth,
        max_request_body_bytes=args.max_request_body_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
        max_stored_responses=args.max_stored_responses,
        tokenizer_cache_tokens=args.tokenizer_cache_tokens,
    )
    listen = ListenOptions(
        host=args.host,
        port=args.port,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_access_log,
        max_waiting_requests=args.max_waiting_requests,
        drain_timeout_s=args.drain_timeout,
    )
    return engine_config_from_args(args), settings, listen
