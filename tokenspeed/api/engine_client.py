"""The slice of `AsyncEngine` the HTTP layer uses, as a structural type.

Routes depend on this protocol rather than on the engine class, so they can
be exercised against a scripted engine in unit tests (the embedded model's
random output cannot produce a given tool call) and the server stays
decoupled from how the engine process is run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from tokenspeed.engine.stream import EngineStats, RequestDelta
from tokenspeed.scheduler.sampling_params import SamplingParams


class EngineClient(Protocol):
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    on_dead: Callable[[], None] | None

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStats: ...
