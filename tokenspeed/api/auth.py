"""API-key authentication: `Authorization: Bearer <key>` (OpenAI SDK) or `x-api-key: <key>` (Anthropic SDK).

The key is compared in constant time. Give it through `TOKENSPEED_API_KEY`
rather than `--api-key`: a command line is visible to every user of the
machine in `ps`.
"""

from __future__ import annotations

import secrets

from fastapi import Request

from tokenspeed.api.errors import APIError
from tokenspeed.api.state import get_state


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
