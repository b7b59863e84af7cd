"""HTTP errors in the two wire formats clients parse.

OpenAI clients read `{"error": {"message", "type", "param", "code"}}`;
Anthropic clients read `{"type": "error", "error": {"type", "message"}}`.
The status code carries the meaning (the SDKs raise by status), the body
says why. Engine errors are typed (`tokenspeed.errors`) and carry their
status; `APIError` covers what only the HTTP layer knows (auth, model names,
a model that failed to write a forced tool call).
"""

from __future__ import annotations

from typing import Any

from tokenspeed.errors import ContextTooLong, TokenSpeedError

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def _encodable(text: str) -> str:
    """`text` with lone surrogates escaped: a message may quote the client's input, and an error
    body that cannot be encoded as UTF-8 would turn a 400 into a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        message = _encodable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else _encodable(param)
        self.code = code


def unknown_model(name: str, served: list[str]) -> APIError:
    return APIError(
        404, f"The model {name!r} does not exist; this server serves {', '.join(served)}.",
        param="model", code="model_not_found",
    )


def model_output_error(message: str) -> APIError:
    return APIError(500, message, code="invalid_model_output")


def from_exception(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, TokenSpeedError):
        code = "context_length_exceeded" if isinstance(exc, ContextTooLong) else None
        return APIError(exc.http_status, str(exc), code=code)
    return APIError(500, f"Internal error: {type(exc).__name__}: {exc}")


def openai_body(error: APIError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": _OPENAI_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error"),
            "param": error.param,
            "code": error.code,
        }
    }


def anthropic_body(error: APIError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(error: APIError, path: str) -> dict[str, Any]:
    return anthropic_body(error) if is_anthropic_path(path) else openai_body(error)
