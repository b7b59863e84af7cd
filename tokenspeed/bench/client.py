"""Async streaming client for OpenAI-compatible servers (ours, vLLM, SGLang, ...).

Timing is taken at the client, per server-sent event, because that is what a
user sees: TTFT is the first event that carries text (role-only and empty
events do not count), inter-token latency is the gap between successive
text-bearing events, counted per token: the client asks for usage in
every event (``stream_options.continuous_usage_stats``, which TokenSpeed and
vLLM honour), so an event that carries k tokens (speculative decoding, or a
tokenizer that decodes many ids to no text) adds k gaps of 1/k of its wait
rather than one long gap. Without per-event usage, each text event counts
as one token. Token totals come from the server's own `usage` (requested
with ``stream_options.include_usage``), including
``prompt_tokens_details.cached_tokens``; a server that omits usage is
recorded as such instead of guessed at.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenspeed.bench.conversation import Message, completion_prompt


@dataclass(slots=True)
class RequestRecord:
    """What one request did, in seconds and server-counted tokens."""

    session_id: str
    turn: int
    start_s: float = 0.0  # send time, relative to the start of its sweep point
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e - TTFT) / (tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(slots=True, frozen=True)
class RequestOptions:
    """Per-run request settings shared by every turn."""

    model: str
    api: str = "chat"  # "chat" | "completions"
    temperature: float = 0.0
    ignore_eos: bool = False
    session_key: bool = False  # send each session's id as OpenAI's `prompt_cache_key` (session retention)


def build_body(
    options: RequestOptions, messages: list[Message], max_tokens: int, session_id: str | None = None
) -> dict[str, Any]:
    """The JSON body of one streaming request."""
    body: dict[str, Any] = {
        "model": options.model,
        "max_tokens": max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if options.ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang/TokenSpeed extension; OpenAI itself ignores unknown keys
    if options.session_key and session_id is not None:
        body["prompt_cache_key"] = session_id
    if options.api == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = completion_prompt(messages)
    return body


def endpoint(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


def _event_text(event: dict[str, Any]) -> tuple[str, str | None]:
    """Text carried by one stream event, and its finish reason if it has one."""
    text = ""
    finish: str | None = None
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text += (delta.get("reasoning_content") or "") + (delta.get("content") or "")
        else:
            text += choice.get("text") or ""
        finish = choice.get("finish_reason") or finish
    return text, finish


def _read_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.usage_reported = True
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = int(details.get("cached_tokens") or 0)


async def stream_request(
    http: httpx.AsyncClient,
    options: RequestOptions,
    messages: list[Message],
    max_tokens: int,
    record: RequestRecord,
) -> str:
    """Send one streaming request, fill `record`, return the reply text ('' on error)."""
    body = build_body(options, messages, max_tokens, record.session_id)
    parts: list[str] = []
    token_events = 0
    start = time.perf_counter()
    last = start
    try:
        async with http.stream("POST", endpoint(options.api), json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                record.error = f"HTTP {response.status_code}: {detail}"
                return ""
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    record.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    break
                now = time.perf_counter()
                text, finish = _event_text(event)
                record.finish_reason = finish or record.finish_reason
                seen = record.output_tokens
                if event.get("usage"):
                    _read_usage(record, event["usage"])
                # Tokens this event carries: from the running usage, else one per text event.
                tokens = record.output_tokens - seen if event.get("usage") and event.get("choices") else int(bool(text))
                if tokens > 0:
                    token_events += 1
                    if record.ttft_s is None:
                        record.ttft_s = now - start  # tokens beside the first one here have no known gap
                    else:
                        record.itl_s.extend([(now - last) / tokens] * tokens)
                    last = now
                if text:
                    parts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.e2e_s = time.perf_counter() - start
    if not record.usage_reported:
        record.output_tokens = token_events  # best effort: one token per event
    return "".join(parts)
