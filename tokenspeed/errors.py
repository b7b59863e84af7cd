"""Typed errors of the engine.

Each maps to one HTTP status in the API layer (`api/errors.py`): callers can tell a
bad request from an overloaded or dead engine without parsing messages.
Pure Python so the scheduler may raise them.
"""

from __future__ import annotations


class TokenSpeedError(Exception):
    """Base class of every error the engine raises on purpose."""

    http_status = 500


class InvalidRequest(TokenSpeedError, ValueError):
    """The request's parameters or inputs are wrong; retrying it unchanged fails again."""

    http_status = 400


class ContextTooLong(InvalidRequest):
    """Prompt (plus requested output) does not fit the model's context window."""

    http_status = 400


class EngineOverloaded(TokenSpeedError):
    """Too many requests are waiting; the client should retry later."""

    http_status = 429


class EngineDead(TokenSpeedError):
    """The engine process or loop has stopped; no request can be served."""

    http_status = 503


class ModelNotSupported(TokenSpeedError, ValueError):
    """The checkpoint's architecture is not one the engine can build."""

    http_status = 400


class ModelNotFound(TokenSpeedError, FileNotFoundError):
    """The model path (or hub id) names nothing that can be loaded."""

    http_status = 404


class NotEnoughMemory(TokenSpeedError):
    """The model (weights plus the smallest KV pool) cannot fit in the memory free on its device.

    Raised at engine start, before anything is allocated, never for a request."""
