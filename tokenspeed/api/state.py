"""`ServerState`: what every route needs, built once per app and kept on `app.state`.

Per-app state rather than module globals, so several apps (tests with
scripted engines, embedders) live in one process without sharing a
renderer, a metrics registry or an engine by accident.
"""

from __future__ import annotations

import time

from fastapi import Request

from tokenspeed.api.engine_client import EngineClient
from tokenspeed.api.errors import unknown_model
from tokenspeed.api.generation import Generation
from tokenspeed.api.metrics import ServerMetrics
from tokenspeed.api.settings import ServerSettings
from tokenspeed.api.templating import ChatRenderer
from tokenspeed.errors import EngineDead
from tokenspeed.scheduler.sampling_params import SamplingParams


class ServerState:
    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.renderer = ChatRenderer(engine.tokenizer, settings.chat_template)
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())

    def check_model(self, name: str | None) -> str:
        """The model name to echo back; 404 for a name this server does not serve."""
        if not name:
            return self.settings.model_name
        if name not in self.settings.served_model_names:
            raise unknown_model(name, self.settings.served_model_names)
        return name

    def check_alive(self) -> None:
        if not self.engine.is_healthy():
            raise EngineDead("The engine is not running.")

    async def start_generation(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Generation:
        """Submit and wait for the first output, so request errors surface before any response byte."""
        self.check_alive()
        generation = Generation(self.engine, self.metrics.timer(), request_id, prompt_token_ids, params)
        await generation.start()
        return generation


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state
