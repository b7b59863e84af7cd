"""`build_app(engine, settings)`: the FastAPI application, independent of how it is served.

The app gets a started engine (anything shaped like `EngineClient`), so the
server process, tests with a scripted engine, and embedders all build it the
same way. Error handling is centralised here: every failure leaves as JSON in
the caller's API dialect (Anthropic's on `/v1/messages*`, OpenAI's
elsewhere), pydantic's validation errors are a 400 (OpenAI clients treat 422
as unexpected), and unknown routes are a 404 in the same shape.

Authentication: with `--api-key`, every `/v1/*`, tokenizer and debug route
wants `Authorization: Bearer <key>` (OpenAI SDK) or `x-api-key: <key>`
(Anthropic SDK); `/health` and `/metrics` stay open for probes and scrapers.
"""

from __future__ import annotations

import logging
import secrets

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenspeed
from tokenspeed.api.engine_client import EngineClient
from tokenspeed.api.errors import APIError, error_body, from_exception
from tokenspeed.api.routes import chat, completions, messages, models, ops, tokenize
from tokenspeed.api.settings import ServerSettings
from tokenspeed.api.state import ServerState, get_state
from tokenspeed.errors import TokenSpeedError

logger = logging.getLogger("tokenspeed.api")


def _supplied_key(request: Request) -> str | None:
    authorization = request.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip()
    return request.headers.get("x-api-key")


async def require_api_key(request: Request) -> None:
    expected = get_state(request).settings.api_key
    if expected is None:
        return
    supplied = _supplied_key(request)
    if supplied is None or not secrets.compare_digest(supplied.encode(), expected.encode()):
        raise APIError(401, "Missing or invalid API key.", code="invalid_api_key")


def _error_response(error: APIError, request: Request) -> JSONResponse:
    if error.status >= 500:
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, error.status, error.message)
    return JSONResponse(error_body(error, request.url.path), status_code=error.status)


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

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error_response(from_exception(exc), request)


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="TokenSpeed", version=tokenspeed.__version__, docs_url=None, redoc_url=None)
    app.state.server = ServerState(engine, settings)
    _install_error_handlers(app)
    guarded = [Depends(require_api_key)]
    for router in (completions.router, chat.router, messages.router, models.router, tokenize.router,
                   ops.debug_router):
        app.include_router(router, dependencies=guarded)
    app.include_router(ops.router)
    return app
