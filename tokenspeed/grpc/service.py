"""The `TokenSpeedScheduler` gRPC service (smg-grpc-proto) on top of `AsyncEngine`.

This is how one replica is driven by the `smg` gateway, which terminates
HTTP, renders chat templates, tokenises, parses tool calls and routes
requests over replicas by cache. The replica only runs token ids: it gets
a prompt and sampling parameters and streams token ids back, so the
per-request work left in this process is small (the detokeniser runs only
for requests with stop strings).

Each RPC maps to one `AsyncEngine` call. Errors are gRPC statuses with the
engine's message (`convert.status_for`): a bad request is INVALID_ARGUMENT
(OUT_OF_RANGE for a context overflow), a full queue RESOURCE_EXHAUSTED, a
dead engine UNAVAILABLE, never a broken stream. A client that goes away
(the gateway cancels the call) aborts the request in the engine, which frees
its KV pages; `Abort` ends a running request, whose stream then completes
with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2, timestamp_pb2
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc

import tokenspeed
from tokenspeed.engine.async_engine import AsyncEngine
from tokenspeed.errors import InvalidRequest, TokenSpeedError
from tokenspeed.grpc.convert import ResponseBuilder, sampling_params_from_proto, status_for
from tokenspeed.grpc.kv_events import KvEventRelay
from tokenspeed.grpc.loads import LoadReporter
from tokenspeed.grpc.tokenizer_bundle import build_bundle, bundle_chunks

logger = logging.getLogger("tokenspeed.grpc")


@dataclass(slots=True)
class ServiceInfo:
    """What `GetModelInfo`/`GetServerInfo` report besides the engine's live numbers."""

    served_model_name: str
    model_path: str
    tokenizer_folder: Path
    server_args: dict[str, Any]
    start_time: float = dataclasses.field(default_factory=time.time)


def _model_config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text())
        return config
    except (OSError, ValueError):
        return {}


class SchedulerService(pb_grpc.TokenSpeedSchedulerServicer):
    def __init__(self, engine: AsyncEngine, info: ServiceInfo) -> None:
        self.engine = engine
        self.info = info
        limits = engine.limits
        self.loads = LoadReporter(engine.stats, page_size=limits.page_size, max_num_seqs=limits.max_num_seqs)
        self.kv_events = KvEventRelay(limits.page_size, self.loads.engine_load)
        engine.on_kv_events = self.kv_events.publish
        self._bundle: asyncio.Task[tuple[bytes, str]] | None = None
        self._model_config = _model_config_json(engine.model_folder)

    # ---- generation ------------------------------------------------------------------------

    async def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        ids = list(request.tokenized.input_ids)
        if ids:
            return ids
        text = request.tokenized.original_text
        if not text:
            raise InvalidRequest("The request has no prompt: tokenized.input_ids and original_text are empty.")
        if self.engine.tokenizer is None:
            raise InvalidRequest("This server has no tokenizer: send tokenized.input_ids.")
        encoded: list[int] = await asyncio.to_thread(self.engine.tokenizer.encode, text)
        return encoded

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if not request.request_id:
                raise InvalidRequest("request_id must not be empty.")
            prompt = await self._prompt(request)
            params = sampling_params_from_proto(request)
            stream = self.engine.generate(request.request_id, prompt, params)
        except TokenSpeedError as exc:
            await context.abort(status_for(exc), str(exc))
        builder = ResponseBuilder(
            request.request_id,
            num_prompt_tokens=len(prompt),
            stream=request.stream,
            no_stop_trim=request.sampling_params.no_stop_trim,
            top_logprobs=max(0, request.top_logprobs_num),
        )
        try:
            async with contextlib.aclosing(stream):  # leaving early (cancelled) aborts in the engine
                async for delta in stream:
                    for item in delta.deltas:
                        if item.finish_reason == "error":
                            raise TokenSpeedError("The engine failed this request.")
                        for response in builder.responses(item, delta.num_cached_tokens):
                            yield response
        except TokenSpeedError as exc:
            await context.abort(status_for(exc), str(exc))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not self.engine.is_running(request.request_id):
            return pb.AbortResponse(success=False, message=f"Request {request.request_id!r} is not running.")
        await self.engine.abort(request.request_id)
        return pb.AbortResponse(success=True, message=f"Aborted {request.request_id!r}.")

    # ---- health, model, server, loads ------------------------------------------------------------

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        if self.engine.is_healthy():
            return pb.HealthCheckResponse(healthy=True, message="ok")
        return pb.HealthCheckResponse(healthy=False, message="The engine is not running.")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        config = self._model_config
        limits = self.engine.limits

        def token_id(name: str) -> int:
            value = config.get(name)
            return value if isinstance(value, int) else 0

        return pb.GetModelInfoResponse(
            model_path=self.info.model_path,
            tokenizer_path=str(self.info.tokenizer_folder),
            served_model_name=self.info.served_model_name,
            model_type=str(config.get("model_type", "")),
            architectures=[str(a) for a in config.get("architectures", [])],
            max_context_length=limits.max_model_len,
            max_req_input_len=limits.max_model_len - 1,
            vocab_size=limits.vocab_size,
            eos_token_ids=list(self.engine.eos_token_ids),
            pad_token_id=token_id("pad_token_id"),
            bos_token_id=token_id("bos_token_id"),
            model_dtype=str(config.get("torch_dtype") or config.get("dtype") or ""),
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        stats = self.engine.stats()
        limits = self.engine.limits
        server_args = struct_pb2.Struct()
        server_args.update(self.info.server_args)
        scheduler_info = struct_pb2.Struct()
        scheduler_info.update(
            {
                "page_size": limits.page_size,
                "num_kv_pages": limits.num_kv_pages,
                "max_num_seqs": limits.max_num_seqs,
                "kv_live_pages_published": self.kv_events.num_live_pages,
            }
        )
        start = timestamp_pb2.Timestamp()
        start.FromSeconds(int(self.info.start_time))
        return pb.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=stats.num_running + stats.num_waiting,
            is_paused=False,
            uptime_seconds=time.time() - self.info.start_time,
            max_total_num_tokens=limits.num_kv_pages * limits.page_size,
            tokenspeed_version=tokenspeed.__version__,
            start_time=start,
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:
        return self.loads.loads_response(request)

    # ---- tokenizer, KV events, admin ---------------------------------------------------------------

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self._bundle is None:
            self._bundle = asyncio.ensure_future(asyncio.to_thread(build_bundle, self.info.tokenizer_folder))
        try:
            data, sha256 = await asyncio.shield(self._bundle)
        except FileNotFoundError as exc:
            self._bundle = None
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        for chunk in bundle_chunks(data, sha256):
            yield chunk

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        async for batch in self.kv_events.subscribe(request, context):
            yield batch

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        return common_pb2.FlushCacheResponse(success=False, message="FlushCache is not supported by this engine.")

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(success=False, message="Profiling over gRPC is not supported.")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(success=False, message="Profiling over gRPC is not supported.")
