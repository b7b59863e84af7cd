"""Which agent session a request belongs to, for session retention of its KV (`--session-ttl`).

When a turn finishes, the engine keeps its pages warm for its session while
the agent runs a tool (kvcache/retention.py). The key comes from what clients
already send:

* OpenAI: `prompt_cache_key` (OpenAI's own cache-routing key), else `user`;
* Anthropic: `cache_control` breakpoints on system, tool or message blocks ask
  for caching; their `ttl` ("5m" default, "1h") becomes the retention TTL. The
  key is `metadata.user_id` when given, else a digest of the request's system
  prompt and tools (what stays fixed across an agent's turns). Without any
  breakpoint, `metadata.user_id` alone is a session with the server's TTL.

Retention is soft (it never blocks admission), so a wrong or shared key costs
only cache efficiency, never correctness.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from tokenspeed.api.protocol import anthropic, openai
from tokenspeed.errors import InvalidRequest

_TTL = re.compile(r"^(\d+)([smh])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600}
_ANTHROPIC_DEFAULT_TTL = 300.0  # "5m"


def openai_session(body: openai.SamplingFields) -> tuple[str | None, float | None]:
    """(session key, ttl) of an OpenAI request; the ttl is the server's (None)."""
    key = getattr(body, "prompt_cache_key", None) or body.user
    return (None, None) if not key else (f"openai:{key}", None)


def parse_ttl(value: object) -> float:
    """Anthropic's `cache_control.ttl` ("5m", "1h", or seconds as "300s") in seconds."""
    if value is None:
        return _ANTHROPIC_DEFAULT_TTL
    match = _TTL.match(value) if isinstance(value, str) else None
    if match is None:
        raise InvalidRequest(f"cache_control.ttl must look like '5m' or '1h', got {value!r}.")
    return float(int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def _breakpoints(body: anthropic.MessagesRequest) -> list[dict[str, Any]]:
    blocks: list[Any] = []
    if isinstance(body.system, list):
        blocks += body.system
    blocks += body.tools or []
    for message in body.messages:
        if isinstance(message.content, list):
            blocks += message.content
    found = []
    for block in blocks:
        control = getattr(block, "cache_control", None)
        if control is None and block.model_extra:
            control = block.model_extra.get("cache_control")
        if control is not None:
            if not isinstance(control, dict) or control.get("type", "ephemeral") != "ephemeral":
                raise InvalidRequest("cache_control must be {'type': 'ephemeral'} with an optional ttl.")
            found.append(control)
    return found


def anthropic_session(body: anthropic.MessagesRequest) -> tuple[str | None, float | None]:
    """(session key, ttl) of an Anthropic request (see the module docstring)."""
    user = (body.metadata or {}).get("user_id")
    breakpoints = _breakpoints(body)
    if not breakpoints:
        return (None, None) if not user else (f"anthropic:{user}", None)
    ttl = max(parse_ttl(control.get("ttl")) for control in breakpoints)
    if not user:
        fixed = {"system": body.system if isinstance(body.system, str) else
                 [b.model_dump() for b in body.system or []],
                 "tools": [t.model_dump() for t in body.tools or []]}
        user = hashlib.blake2b(json.dumps(fixed, sort_keys=True).encode(), digest_size=12).hexdigest()
    return f"anthropic:{user}", ttl
