"""`ServerState`: what every route needs, built once per app and kept on `app.state`.

Per-app state rather than module globals, so several apps (tests with
scripted engines, embedders) live in one process without sharing a
renderer, a metrics registry or an engine by accident.

Tokenising and template rendering run in worker threads (`encode`,
`render`): a megabyte prompt takes the tokenizer about a second, which on
the event loop would stall `/health` and every other stream. The Rust
tokenizer releases the GIL while it works.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import anyio
from fastapi import Request

from tokenspeed.api.conversation import Conversation
from tokenspeed.api.engine_client import EngineClient
from tokenspeed.api.errors import unknown_model
from tokenspeed.api.generation import Generation
from tokenspeed.api.metrics import ServerMetrics
from tokenspeed.api.parsers import REASONING_PARSERS, TOOL_FORMATS
from tokenspeed.api.responses_store import ResponseStore
from tokenspeed.api.settings import ServerSettings
from tokenspeed.api.templating import ChatRenderer, RenderedPrompt
from tokenspeed.api.tool_policy import ToolPolicy
from tokenspeed.errors import EngineDead
from tokenspeed.scheduler.sampling_params import SamplingParams


class ServerState:
    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.renderer = ChatRenderer(engine.tokenizer, settings.chat_template, settings.tokenizer_cache_tokens)
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())
        self.parsers_need_special_tokens = _hides_any(engine.tokenizer, _parser_markers(settings))
        self.responses = ResponseStore(settings.max_stored_responses)
        # Markers a tool-call grammar matches as tokens (tool_grammar.py).
        self.added_tokens = frozenset(getattr(engine.tokenizer, "get_added_vocab", dict)())

    def check_model(self, name: str | None) -> str:
        """The model name to echo back; 404 for a name this server does not serve."""
        if not name:
            return self.settings.model_name
        if name not in self.settings.served_model_names:
            raise unknown_model(name, self.settings.served_model_names)
        return name

    async def encode(self, text: str) -> list[int]:
        """Raw text → token ids (special-token strings count as such: the client wrote the whole prompt)."""
        return await anyio.to_thread.run_sync(self.renderer.encode, text)

    async def render(self, conversation: Conversation, **options: Any) -> RenderedPrompt:
        """`ChatRenderer.render`, off the event loop."""
        return await anyio.to_thread.run_sync(functools.partial(self.renderer.render, conversation, **options))

    def parses_output(self, policy: ToolPolicy) -> bool:
        """Do this request's outputs go through the tool-call or reasoning parsers?"""
        return policy.tool_format is not None or self.settings.reasoning_parser is not None

    def check_alive(self) -> None:
        if not self.engine.is_healthy():
            raise EngineDead("The engine is not running.")

    async def start_generation(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, parsed: bool = False
    ) -> Generation:
        """Submit and wait for the first output, so request errors surface before any response byte.

        `parsed`: the output goes through the tool/reasoning parsers, which may need special tokens kept."""
        self.check_alive()
        keep_special = parsed and self.parsers_need_special_tokens and params.skip_special_tokens
        if keep_special:
            params = dataclasses.replace(params, skip_special_tokens=False)
        generation = Generation(self.engine, self.metrics.timer(), request_id, prompt_token_ids, params,
                                hide_stop_token=keep_special)
        await generation.start()
        return generation


def _parser_markers(settings: ServerSettings) -> tuple[str, ...]:
    markers: tuple[str, ...] = ()
    if settings.tool_call_parser is not None:
        markers += TOOL_FORMATS[settings.tool_call_parser].markers
    if settings.reasoning_parser is not None:
        markers += REASONING_PARSERS[settings.reasoning_parser].markers
    return markers


def _hides_any(tokenizer: Any, markers: tuple[str, ...]) -> bool:
    """Would decoding with `skip_special_tokens` drop any of `markers` (they are special tokens)?"""
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if tokenizer.decode(ids, skip_special_tokens=True) != marker:
            return True
    return False


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state
