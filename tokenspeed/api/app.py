"""`build_app(engine, settings)`: the FastAPI application, independent of how it is served.

The app gets a started engine (anything shaped like `EngineClient`), so the
server process, tests with a scripted engine, and embedders all build it the
same way. Error handling is centralised here: every failure leaves as JSON in
the caller's API dialect (Anthropic's on `/v1/messages*`, OpenAI's
elsewhere), pydantic's validation errors are a 400 (OpenAI clients treat 422
as unexpected), and unknown routes are a 404 in the same shape.

An exception no handler knows becomes a 500 in `middleware.CatchUnexpected`
rather than in a Starlette handler for `Exception`: Starlette re-raises after
such a handler, and uvicorn then drops the client's keep-alive connection.
Bodies over `max_request_body_bytes` are refused (413) before parsing.
Overload (429) and a dead engine (503) carry `Retry-After`.

Authentication (`auth.py`): with an API key, every `/v1/*`, tokenizer and
debug route wants it; `/health` stays open for probes, and `/metrics` too
unless `metrics_require_auth`.
"""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenspeed
from tokenspeed.api.auth import require_api_key
from tokenspeed.api.engine_client import EngineClient
from tokenspeed.api.errors import APIError, error_body, from_exception
from tokenspeed.api.middleware import BodyLimit, CatchUnexpected
from tokenspeed.api.routes import chat, completions, messages, models, ops, responses, tokenize
from tokenspeed.api.settings import ServerSettings
from tokenspeed.api.state import ServerState
from tokenspeed.errors import TokenSpeedError

logger = logging.getLogger("tokenspeed.api")


RETRY_AFTER_S = 1  # what 429 and 503 answers suggest; a restarted engine is back within seconds


def _error_response(error: APIError, request: Request) -> JSONResponse:
    if error.status >= 500:
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, error.status, error.message)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
    return JSONResponse(error_body(error, request.url.path), status_code=error.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for error in exc.errors():
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        param = param or location or None
        parts.append(f"{location}: {error.get('msg')}" if location else str(error.get("msg")))
    return "; ".join(parts) or "Invalid request body.", param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc, request)

    @app.exception_handler(TokenSpeedError)
    async def engine_error(request: Request, exc: TokenSpeedError) -> JSONResponse:
        return _error_response(from_exception(exc), request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(APIError(400, message, param=param), request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail)), request)


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="TokenSpeed", version=tokenspeed.__version__, redoc_url=None)  # /docs, /openapi.json
    app.state.server = ServerState(engine, settings)
    _install_error_handlers(app)
    guarded = [Depends(require_api_key)]
    for router in (completions.router, chat.router, messages.router, responses.router, models.router,
                   tokenize.router, ops.debug_router):
        app.include_router(router, dependencies=guarded)
    app.include_router(ops.router)
    app.add_middleware(CatchUnexpected)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body_bytes)
    return app
