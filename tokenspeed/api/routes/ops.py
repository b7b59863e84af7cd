"""Operator endpoints: `/health`, `/metrics`, `/debug/kv`.

`/metrics` is open for scrapers unless `--metrics-require-auth`.
`/health` is 503 as soon as the engine is dead (a load balancer must stop
sending traffic before the process exits). `/debug/kv` shows the KV page
accounting (free + referenced + cached == total), e.g. to confirm that
aborted requests released their pages; it sits behind the API key.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenspeed.api.auth import require_api_key
from tokenspeed.api.errors import APIError, openai_body
from tokenspeed.api.metrics import CONTENT_TYPE
from tokenspeed.api.state import get_state

router = APIRouter()
debug_router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    state = get_state(request)
    if not state.engine.is_healthy():
        return JSONResponse(openai_body(APIError(503, "The engine is dead.")), status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = get_state(request)
    if state.settings.metrics_require_auth:
        await require_api_key(request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@debug_router.get("/debug/kv")
async def kv_pages(request: Request) -> JSONResponse:
    state = get_state(request)
    stats = state.engine.stats()
    body = dataclasses.asdict(stats)
    body["healthy"] = state.engine.is_healthy()
    body["engine_pid"] = getattr(state.engine, "pid", None)
    return JSONResponse(body)
